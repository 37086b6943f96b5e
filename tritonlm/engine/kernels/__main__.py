"""`python -m tritonlm.engine.kernels`: load the kernels and say which build (the level this CPU
runs, prebuilt or compiled now) and from where.

`python -m tritonlm.engine.kernels --prebuild [--isa avx2,portable]`: compile every ISA level
(or those named) into the prebuilt folder (TRITONLM_KERNELS_DIR, else the package's
`prebuilt/`), once, ahead of any server: `make setup` and an image build run it. A level
fails alone (reported, exit 1); the loader then takes the best level that did build."""

import argparse
import sys

from tritonlm.engine.kernels import isa

parser = argparse.ArgumentParser(prog="python -m tritonlm.engine.kernels", description=__doc__.split("\n\n")[0])
parser.add_argument("--prebuild", action="store_true", help="compile the ISA levels into the prebuilt folder")
parser.add_argument("--isa", default="", help=f"comma-separated levels to prebuild (default all: {','.join(isa.NAMES)})")
args = parser.parse_args()

if args.prebuild:
    from tritonlm.engine.kernels.build import prebuild, prebuilt_dir, why_not_buildable

    names = [n.strip() for n in args.isa.split(",") if n.strip()]
    for n in names:
        isa.level(n)  # an unknown name fails before any compile
    cannot = why_not_buildable()
    if cannot is not None:
        print(f"C++ kernels: not prebuilt: {cannot}; decode runs on the torch path")
        sys.exit(0)  # no compiler is not a setup failure
    print(f"C++ kernels: prebuilding {', '.join(names or isa.NAMES)} into {prebuilt_dir()}", flush=True)
    results = prebuild(names or None)
    for name, ok, what in results:
        print(f"  {name:12s} {'ok' if ok else 'FAILED'}  {what}")
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)

from tritonlm.engine.kernels import kernels_available  # noqa: E402

try:
    ok, why = kernels_available()
except isa.IsaError as e:
    print(f"C++ kernels: refused: {e}")
    sys.exit(2)
print(f"C++ kernels (paged attention, fused norms): {'ok' if ok else 'unavailable'} ({why})")
sys.exit(0)  # unavailable is not a setup failure: decode runs on the torch path

"""`python -m tritonlm.engine.kernels`: build the kernels now (`make setup` does, once,
before any server would race to) and say whether they load."""

import sys

from tritonlm.engine.kernels import kernels_available

ok, why = kernels_available()
print(f"C++ kernels (paged attention, fused norms): {'ok' if ok else 'unavailable'} ({why})")
sys.exit(0)  # unavailable is not a setup failure: decode runs on the torch path

"""tritonlm/perf/machine.py: the CPU line every benchmark prints with its figures."""

from __future__ import annotations

from tritonlm.perf.machine import FLAGS, describe_cpu, usable_cores

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: Another CPU
flags\t\t: fpu avx2 amx_int8
"""


def test_the_cpu_line_names_the_first_processor_its_generation_and_its_speed_flags(tmp_path):
    """One name covers several generations (an AMD EPYC may be Zen 2 to Zen 5), so the family
    and model follow it; only FLAGS's flags are listed, in FLAGS's order, from the first
    processor alone."""
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert describe_cpu(str(path)) == f"AMD EPYC (family 26 model 2) | {usable_cores()} cores | avx2 avx512f avx512_vnni"


def test_a_host_without_cpuinfo_or_speed_flags_still_gets_a_line(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Some ARM core\nflags\t\t: fp asimd\n")
    assert describe_cpu(str(path)) == f"Some ARM core | {usable_cores()} cores | none of {'/'.join(FLAGS)}"
    line = describe_cpu(str(tmp_path / "missing"))
    assert line.endswith(f"| {usable_cores()} cores | none of {'/'.join(FLAGS)}") and line.split(" | ")[0]

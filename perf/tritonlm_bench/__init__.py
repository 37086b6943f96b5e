"""What the benchmark scripts in perf/ share (streaming clients, model repositories, the
CPU split, reference decode loops, ...): perf/tritonlm_bench/README.md maps the modules.

Installed beside tritonlm by `pip install -e .` (pyproject.toml), so the scripts and the
tests import it without touching sys.path. It is not part of tritonlm: nothing in tritonlm
imports it; it imports tritonlm.
"""

"""tritonlm/proc_exit.py: exit statuses in words, checked against real children's returncodes."""

from __future__ import annotations

import signal
import subprocess
import sys

from tritonlm.proc_exit import describe_exit


def test_a_real_exit_code_and_a_real_signal_in_words():
    exited = subprocess.run([sys.executable, "-c", "raise SystemExit(3)"])
    assert describe_exit(exited.returncode) == "exit code 3"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child.send_signal(signal.SIGKILL)
    assert describe_exit(child.wait()) == "signal SIGKILL"
    assert describe_exit(0) == "exit code 0"


def test_a_signal_number_without_a_name_is_given_as_a_number():
    unnamed = next(n for n in range(1, 200) if n not in {s.value for s in signal.Signals})
    assert describe_exit(-unnamed) == f"signal {unnamed}"

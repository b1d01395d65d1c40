"""A stage process ends without the interpreter's teardown, but with what atexit holds."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, logging, sys
from vllm_omni_plugin.stages.worker import exit_without_finalization

class Teardown:
    def __del__(self):
        print("module teardown ran", flush=True)

kept = Teardown()  # a module global: only the interpreter's teardown would delete it
atexit.register(lambda: print("atexit ran", flush=True))
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
logging.getLogger("stage").info("stopped")
print("buffered line", end="")  # no newline, no flush: exit_without_finalization flushes
exit_without_finalization(3)
"""


def test_exit_runs_atexit_flushes_and_skips_teardown():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    assert done.returncode == 3
    assert "atexit ran" in done.stdout and "buffered line" in done.stdout
    assert "module teardown ran" not in done.stdout
    assert "INFO:stage:stopped" in done.stderr

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


FORK_PROGRAM = """
import multiprocessing, os, socket, sys
from vllm_omni_plugin.stages.worker import release_in_forked_children

ours, theirs = socket.socketpair()
release_in_forked_children(ours.fileno())

def report(queue, done):
    queue.put(os.readlink(f"/proc/self/fd/{ours.fileno()}"))
    done.wait(60)  # alive while the parent closes its end

ctx = multiprocessing.get_context("fork")
queue, done = ctx.Queue(), ctx.Event()
child = ctx.Process(target=report, args=(queue, done))
child.start()
print("child", queue.get(timeout=60))
print("parent", os.readlink(f"/proc/self/fd/{ours.fileno()}"))
ours.close()  # the child still runs: EOF only if it does not hold the socket
theirs.settimeout(30)
print("peer", theirs.recv(1) == b"")
done.set()
child.join(60)
"""


def test_a_forked_child_does_not_hold_the_control_socket():
    """vLLM's engine core, forked from a stage, gets /dev/null where the stage's control
    socket was: once the stage closes its end (or dies), the orchestrator reads EOF, though
    the engine core still runs."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_PROGRAM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["child"] == "/dev/null"
    assert lines["parent"].startswith("socket:")
    assert lines["peer"] == "True"

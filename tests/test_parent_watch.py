"""common/parent_watch.py with real processes: a watched parent's death reaches the child at once,
a parent that died before the watch started too, and end_process_tree takes the child's whole
process group. The served cases (stage processes, a headless node) are in
tests/serving/test_shutdown_serve.py and tests/multinode/test_node_parent_death.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 10.0

# The child: watches its parent (argv[1]: the pid it was told, or "-" for its parent now);
# on the parent's death it writes the pid it was given to argv[2] and exits.
CHILD = """
import os, sys, time
from vllm_omni_plugin.common.parent_watch import watch_parent

def gone(pid):
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(pid))
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    os._exit(0)

watch_parent(gone, None if sys.argv[1] == "-" else int(sys.argv[1]))
print("watching", flush=True)
time.sleep(600)
"""

# The parent: starts the child (its stdout inherited), prints the child's pid, then waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(child.pid, flush=True)
time.sleep(600)
"""

# A process group leader with a grandchild; both die with end_process_tree().
LEADER = """
import subprocess, sys, time
from vllm_omni_plugin.common.parent_watch import end_process_tree
sub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(sub.pid, flush=True)
sys.stdin.readline()
end_process_tree()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(cond, what: str, timeout: float = DEADLINE_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s")


def test_child_exits_when_its_parent_is_killed(tmp_path):
    marker = tmp_path / "gone"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, "-", str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "watching"
        assert not marker.exists()
        parent.kill()
        parent.wait()
        took = _wait_until(lambda: _gone(child), "the child did not exit")
        assert marker.read_text() == str(parent.pid)
        assert took < 2.0, took  # a pidfd wakes the watch at once, no polling period
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_parent_gone_before_the_watch_is_noticed(tmp_path):
    # The child is told a pid that is not its parent's (the parent it had died before it
    # looked): it acts at once instead of watching whoever adopted it.
    marker = tmp_path / "gone"
    ghost = subprocess.Popen([sys.executable, "-c", "pass"])
    ghost.wait()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ghost.pid), str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        child.wait(DEADLINE_S)
        assert marker.read_text() == str(ghost.pid)
    finally:
        if child.poll() is None:
            child.kill()


def test_end_process_tree_takes_the_process_group(tmp_path):
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    grandchild = int(leader.stdout.readline())
    try:
        leader.stdin.write("go\n")
        leader.stdin.flush()
        assert leader.wait(DEADLINE_S) == -signal.SIGKILL
        _wait_until(lambda: _gone(grandchild), "the grandchild outlived its group")
    finally:
        for pid in (leader.pid, grandchild):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)

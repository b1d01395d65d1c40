"""The AR stage lowers its vLLM workers' priority (vLLM busy-polls in them for 1 s after each
step; see ar_stage.py). Real child processes named like vLLM's, so no vLLM engine is needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from vllm_omni_plugin.stages import ar_stage

# A child that names itself like a vLLM worker (or not), starts a second thread, then waits.
CHILD = """
import sys, threading, time
from setproctitle import setproctitle
setproctitle(sys.argv[1])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def _spawn(title: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, title], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def _thread_nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()]


def test_only_vllm_workers_get_the_lower_priority_on_every_thread():
    worker, other = _spawn("VLLM::Worker"), _spawn("VLLM::EngineCore")
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(worker.pid).name() != "VLLM::Worker":
            assert time.monotonic() < deadline, "the child never took its title"
            time.sleep(0.05)
        done = ar_stage.lower_worker_priority(7)
        assert done == [worker.pid]
        nices = _thread_nices(worker.pid)
        assert len(nices) >= 2 and set(nices) == {7}  # nice is per thread on Linux
        assert set(_thread_nices(other.pid)) == {0}
    finally:
        for proc in (worker, other):
            proc.kill()
            proc.wait()


def test_worker_nice_setting(monkeypatch):
    monkeypatch.setenv(ar_stage.WORKER_NICE_ENV, "0")
    assert ar_stage.worker_nice() == 0
    monkeypatch.delenv(ar_stage.WORKER_NICE_ENV)
    # This machine is vLLM's CPU platform: the CPU default applies.
    assert ar_stage.worker_nice() == ar_stage.CPU_DEFAULT_WORKER_NICE == 19

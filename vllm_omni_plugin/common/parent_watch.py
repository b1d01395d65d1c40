"""A process that ends with its parent: stage processes and headless nodes.

A stage process reads EOF on its control socket when its API server (or headless node) dies,
but only while its loop reads that socket: not while it loads its model or builds its vLLM
engine (tens of seconds, more on a loaded host), nor inside a long engine step, so a SIGKILLed
API server could leave a stage loading on for a minute. A headless node has no connection to
whoever started it at all: with its launcher gone it would go on waiting for a head and
restarting its stages for good. Each of them watches its parent process instead, from a thread
that does nothing else, and acts at once when it dies.

The watch is a pidfd of the parent (Linux 5.3+), which becomes readable when the parent
process exits, whichever of its threads started us. prctl(PR_SET_PDEATHSIG) is not used: it
fires when the thread that forked us ends (the orchestrator starts stages from executor
threads), and its signal would end the stage alone, leaving the vLLM engine core and workers
of the stage's process group behind. Without pidfd the thread polls getppid() instead.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("vllm_omni_plugin.parent_watch")

POLL_S = 0.5  # getppid() polling, only where pidfd_open is missing


def watch_parent(
    on_death: Callable[[int], None], parent_pid: int | None = None
) -> threading.Thread | None:
    """Call `on_death(parent_pid)` from a daemon thread once the parent process is gone.

    `parent_pid`: the pid the parent had when it started us (it passes its own), so that a
    parent that died before this call is noticed too; None: this process's parent now. Returns
    the watching thread, or None when there is no parent to outlive: pid 0 or 1, init or a
    container's runtime, whose death ends everything anyway."""
    expected = os.getppid() if parent_pid is None else parent_pid
    if expected <= 1:
        return None
    pidfd = None
    if os.getppid() == expected:
        try:
            pidfd = os.pidfd_open(expected)
        except (AttributeError, OSError):  # an old kernel (or Python): poll getppid()
            pidfd = None
    thread = threading.Thread(
        target=_wait, args=(expected, pidfd, on_death), name="omni-parent-watch", daemon=True
    )
    thread.start()
    return thread


def _wait(parent: int, pidfd: int | None, on_death: Callable[[int], None]) -> None:
    # The parent may have died (and its pid been reused) before pidfd_open: getppid() is then
    # no longer `parent` (we were reparented), checked after the pidfd is open.
    if pidfd is not None and os.getppid() == parent:
        select.select([pidfd], [], [])
    else:
        while os.getppid() == parent:
            time.sleep(POLL_S)
    if pidfd is not None:
        os.close(pidfd)
    on_death(parent)


def end_process_tree() -> None:
    """SIGKILL everything this process started, then its process group when it leads one (a
    stage process does: its vLLM engine core and workers are in it, even one started since),
    then itself."""
    try:
        import psutil  # a vLLM dependency

        children = psutil.Process().children(recursive=True)
    except Exception:  # the group and the children's own watches still end them
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:  # gone already
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

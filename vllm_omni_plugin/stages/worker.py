"""Entry point of a stage process: `python -m vllm_omni_plugin.stages.worker --fd=N omni-stage-K`.

The orchestrator passes one end of a socket pair as fd N; the first message on it is the
stage's StartStage (messages.py), read back into its typed StageInit. The worker names itself `omni-stage-<id>` (ps shows it), loads its
stage runner, says Ready, and serves until Shutdown or until the socket closes (the API server
is gone). It also watches the process that started it (`--parent-pid`): once that is gone, a
serving stage gets PARENT_GONE_GRACE_S to stop by itself (the socket's EOF, which it reads at
once), then its whole process group is killed, its engine's processes with it, whatever it is
doing (a long step, a stuck shutdown); a stage still starting (loading its model) at once.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import NoReturn

import msgspec
from pydantic import ValidationError

from ..common.channel import MessageChannel
from ..common.exit_status import EXIT_CONFIG
from ..common.messages import Ready, StartStage
from ..common.parent_watch import end_process_tree, watch_parent
from ..config.stage_init import StageInit
from .loops import loop_class
from .stats_relay import StatsRelay

# After the parent died: how long a stage may take to stop cleanly before its process group
# is killed. A serving stage stops at the socket's EOF, an AR stage's vLLM engine in up to
# ~5.5 s (its workers' shutdown recheck, see orchestrator/stage_process.STOP_WAIT_S).
PARENT_GONE_GRACE_S = 6.0


_serving = threading.Event()  # set once the stage said Ready: it reads its socket from then on


def _parent_gone(parent: int) -> None:
    # Runs in the watch thread; the main thread may be anywhere (loading, stepping, closing).
    logging.getLogger("omni-stage").warning(
        "the process that started this stage (pid %d) is gone; exiting", parent
    )
    if _serving.is_set():
        time.sleep(PARENT_GONE_GRACE_S)  # a clean exit ends the process (and this thread) first
    end_process_tree()


def env_state(name: str, configured: object) -> str:
    """ "as configured", "differs" or "unset": how this process's `name` compares with `env:`."""
    value = os.environ.get(name)
    if value is None:
        return "unset"
    return "as configured" if value == str(configured) else "differs"


def _set_title(init: StageInit) -> None:
    try:
        from setproctitle import setproctitle
    except ImportError:  # the title is also in argv, which ps shows
        return
    setproctitle(f"omni-stage-{init.stage.stage_id} ({init.spec.kind}, {init.pipeline})")


def release_in_forked_children(fd: int) -> None:
    """A process forked from this one (vLLM starts its engine core so on GPUs, and on the CPU
    where the stage's torch runs one thread: ar_stage.engine_core_start_method) would hold the
    control socket open too, so the orchestrator would see no EOF if this stage died before it.
    In each forked child the fd is pointed at /dev/null: the socket is released there, and the
    number stays valid, so nothing the child closes later closes another file."""

    def release() -> None:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd, inheritable=False)
        os.close(null)

    os.register_at_fork(after_in_child=release)


def make_runner(init: StageInit, conn: MessageChannel):
    """The stage's loop (loop.StageLoop): the topology's `runner`, else its kind's."""
    return loop_class(init.spec)(init, conn)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("title", nargs="?")
    args = parser.parse_args(argv)
    watch_parent(_parent_gone, args.parent_pid)
    os.set_inheritable(args.fd, False)  # children (a vLLM EngineCore) must not hold it
    release_in_forked_children(args.fd)
    conn = MessageChannel(Connection(args.fd))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    start = conn.recv()
    if not isinstance(start, StartStage):
        raise SystemExit(f"expected StartStage first, got {type(start).__name__}")
    init = StageInit.from_message(start)
    _set_title(init)
    log = logging.getLogger(f"omni-stage-{init.stage.stage_id}")
    t0 = time.monotonic()
    try:
        # StatsRelay: each Result carries this process's connector counters to /metrics.
        runner = make_runner(init, StatsRelay(conn))
    except ValidationError as exc:  # vLLM's config classes validate with pydantic
        log.error("the stage's engine refused its settings:\n%s", exc)
        return EXIT_CONFIG
    info = runner.info()
    # The stage's own environment, read back here (/proc/<pid>/environ is not reliable once
    # setproctitle has reused the environ block for the title): for each `env:` name, whether
    # this process has the configured value. Names only: values can be secrets, and this info
    # is shown by GET /v1/omni/stages. The devices it sees (from `devices`) stay readable.
    environ: dict[str, str | None] = {k: env_state(k, v) for k, v in init.stage.env.items()}
    environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    info.effective = msgspec.structs.replace(info.effective, environ=environ)
    log.info("loaded in %.1f s: %s", time.monotonic() - t0, info)
    try:
        # Sending Ready is inside the try: if the API server went away while we loaded,
        # this fails and `finally` still stops what the runner started (a vLLM EngineCore).
        edge_address = runner.edge_address()
        ready = Ready(os.getpid(), info, edge_address, runner.edge_tcp_address())
        conn.send(ready)
        _serving.set()
        runner.serve()
    except (EOFError, OSError):
        log.info("control connection closed; exiting")
    finally:
        t0 = time.monotonic()
        runner.close()
        log.info("stopped in %.1f s", time.monotonic() - t0)
    return 0


def exit_without_finalization(code: int) -> NoReturn:
    """End the process once its stage has stopped: what was registered with atexit runs
    (logging's flush, multiprocessing's and torch's finalizers), the interpreter's own
    teardown does not. That teardown is a full garbage collection over torch's, vLLM's and the
    model's objects: seconds of CPU per stage process (measured: 1 to 2.5 s for each tiny
    GLM-Image stage on a 2-core host), spent after everything was released, only to end."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalization(main())

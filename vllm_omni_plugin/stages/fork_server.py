"""The process stages are forked from: `python -m vllm_omni_plugin.stages.fork_server --fd=N
--preload=MODULES`.

A stage started as a fresh interpreter imports torch, transformers and its engine's libraries
before it reads its first message, ~8 CPU-seconds where that engine is vLLM's (on a 2-core
host), and every stage of a pipeline and every restart pays it again. This process imports what
the stages of its pipeline load (MODULES) once and forks each stage from itself, so a stage
starts with them in memory (shared, copy-on-write). It does nothing else: it starts no thread,
no CUDA context and no OpenMP pool, which a forked child could not use. (Forking the API server
itself would copy its threads and event loop.)

The orchestrator (orchestrator/stage_fork.py) holds the other end of socket N, a SOCK_SEQPACKET
pair: one message per packet (common/messages.py, msgpack). Each ForkStage comes with two
descriptors, the stage's control socket and the write end of its log pipe, and is answered by
Forked(pid); StageExited(pid, returncode) follows when that child ends. At EOF (the
orchestrator is gone) this process exits; its stages see their parent go and stop
(stages/worker.py).

A forked child makes itself what a stage started as a fresh interpreter is: a process in a new
session (so killing its process group ends it and everything it starts), with stdout and stderr
on the log pipe, stdin on /dev/null, and the environment the orchestrator computed for it. Only
variables read when used may differ from this process's (stage_fork.read_at_load_differences).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import socket
import sys
import time

from ..common.messages import (
    Forked,
    ForkServerReady,
    ForkStage,
    StageExited,
    encode,
    fork_request_decoder,
)

# What every stage imports before it reads its first message; `--preload` names the rest (its
# pipeline's engines: orchestrator/stage_fork.modules_to_preload).
PRELOAD = ("torch", "vllm_omni_plugin.stages.worker")

MAX_REQUEST_BYTES = 1 << 20  # argv + environment; an environment is a few KB


def _reply(sock: socket.socket, message: Forked | ForkServerReady | StageExited) -> None:
    try:
        sock.send(encode(message))
    except OSError:  # the orchestrator is gone: the next recv reads EOF
        pass


def serve(sock: socket.socket) -> list[str] | None:
    """Fork a child per request until EOF (then None). In a child, which has become its stage
    by then (become_stage), returns the worker's argv."""
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for pidfd in readable:
            if pidfd is sock:
                continue
            pid = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            _reply(sock, StageExited(pid, os.waitstatus_to_exitcode(status)))
        if sock not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 2)
        if not data:
            return None
        request = fork_request_decoder.decode(data)
        settled_r, settled_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(settled_r)
            sock.close()
            for pidfd in children:
                os.close(pidfd)
            # The stage whole before the orchestrator hears of it: from then on it may kill
            # the stage's process group, look for it by its title or read its folder.
            try:
                os.setsid()
                _set_title(request.title)
                argv = become_stage(request, fds)
            except BaseException as exc:  # its folder is gone, ...: it ends, reported as 1
                os.write(2, f"{request.title} could not start: {exc!r}\n".encode())
                os._exit(1)
            os.close(settled_w)
            return argv
        os.close(settled_w)
        os.read(settled_r, 1)  # EOF once the child closed its end (or died)
        os.close(settled_r)
        for fd in fds:
            os.close(fd)
        children[os.pidfd_open(pid)] = pid
        _reply(sock, Forked(pid))


def become_stage(request: ForkStage, fds: list[int]) -> list[str]:
    """In a forked child: take on the stage's streams, environment and working folder; returns
    the worker's argv with the control socket's descriptor."""
    control, log = fds
    signal.signal(signal.SIGINT, signal.default_int_handler)  # this server ignores it
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for stream in (1, 2):
        os.dup2(log, stream)
    os.close(log)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    return [f"--fd={control}", *request.argv]


def _set_title(title: str) -> None:
    try:
        from setproctitle import setproctitle
    except ImportError:  # ps then shows this server's command line
        return
    setproctitle(title)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--preload", default="", help="modules to import, comma-separated")
    args = parser.parse_args()
    # Ctrl-C in a terminal reaches the API server's process group, this process included: the
    # server stops its stages itself, and this process ends at EOF.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_title("omni-fork-server")
    # It learns of each child's end from a pidfd (Linux 5.3+): without one, it cannot serve,
    # and the orchestrator starts its stages as fresh interpreters.
    os.close(os.pidfd_open(os.getpid()))
    t0 = time.monotonic()
    modules = (*PRELOAD, *filter(None, args.preload.split(",")))
    for module in modules:
        importlib.import_module(module)
    print(
        f"omni-fork-server: imported {', '.join(modules)} in {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    import torch

    if torch.cuda.is_initialized():  # an import started CUDA, which no forked child could use
        raise SystemExit("omni-fork-server: CUDA started during the imports; not serving")
    sock = socket.socket(fileno=args.fd)
    _reply(sock, ForkServerReady(os.getpid()))
    argv = serve(sock)
    if argv is None:
        return
    from . import worker

    sys.argv = [worker.__file__, *argv]
    worker.exit_without_finalization(worker.main(argv))


if __name__ == "__main__":
    main()

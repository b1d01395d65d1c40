"""Stage processes forked by the fork server (stages/fork_server.py) instead of started fresh.

A process that starts stages (an API server, a headless node) starts a fork server with its
first stage and keeps it; the server imports torch and what its pipeline's stages load
(transformers, vLLM's engine where a stage runs one, diffusers where one paints) once, and every
stage after that, restarts included, is a fork of it. StageProcess uses the ForkedProcess it
gets back as it used a subprocess.Popen: pid, poll, wait, stdout.

The server's imports read some variables as they load (READ_AT_LOAD_PREFIXES: PYTHONPATH,
OMP_NUM_THREADS, HF_HOME, ...), so each set of their values (and each set of modules to import)
gets a server of its own: a second orchestrator in the process whose environment differs in one
gets another server, and a server that has no stage left is closed then. A stage whose own
`env:` gives one of them a value of its own gets a fresh interpreter, as does every stage on a
host where the fork server cannot run (no pidfd, a failed import): slower to start, the same
stage. Other variables (CUDA_VISIBLE_DEVICES from its `devices`, NCCL's, the plugin's own) are
read when used, in the stage. VLLM_OMNI_STAGE_FORK=0 starts every stage fresh.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import IO

from ..common.messages import (
    Forked,
    ForkServerReady,
    ForkStage,
    StageExited,
    encode,
    fork_server_decoder,
)

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

FORK_ENV = "VLLM_OMNI_STAGE_FORK"
# Variables that the C runtime, Python, OpenMP and BLAS, torch and Triton, the Hugging Face
# libraries (their cache folders come from HOME and XDG_*) and vLLM may read as they load, in the
# fork server. The plugin's own (VLLM_OMNI_*) are read when used.
READ_AT_LOAD_PREFIXES = (
    "LD_", "MALLOC_", "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH",
    "PYTORCH_", "TRITON_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "HOME",
    "XDG_", "TMPDIR", "LANG", "LC_", "VLLM_",
)  # fmt: skip
READ_WHEN_USED_PREFIXES = ("VLLM_OMNI_",)
# What a stage of each kind imports as it loads, torch aside: its loop (stages/loops.py) and its
# engine's libraries. vLLM's engine is most of it (~5 CPU-s of ~8), and only the AR and talker
# kinds run one.
_VLLM_ENGINE = ("vllm.v1.engine.async_llm", "vllm.v1.worker.gpu_model_runner")
_LOADS: dict[str, tuple[str, ...]] = {
    "ar": ("transformers", *_VLLM_ENGINE, "vllm_omni_plugin.stages.ar_stage"),
    "talker": ("transformers", *_VLLM_ENGINE, "vllm_omni_plugin.stages.qwen3_omni"),
    "code2wav": ("transformers", "vllm_omni_plugin.stages.qwen3_omni"),
    "diffusion": ("transformers", "diffusers", "vllm_omni_plugin.stages.diffusion_stage"),
}
# The server's imports: about 10 s of CPU, more on a loaded host. Past this, stages start fresh.
SERVER_READY_S = 120.0
REPLY_S = 30.0  # a fork and its reply
MAX_REPLY_BYTES = 4096


def _read_at_load(name: str) -> bool:
    return name.startswith(READ_AT_LOAD_PREFIXES) and not name.startswith(READ_WHEN_USED_PREFIXES)


def read_at_load_differences(env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """The variables read as a library loads that a stage with environment `env` would hold
    other values of (or lack, or add) than a fork server started with `server_env`: a stage
    is forked only where there are none."""
    return sorted(
        name
        for name in env.keys() | server_env.keys()
        if env.get(name) != server_env.get(name) and _read_at_load(name)
    )


def modules_to_preload(kinds: Iterable[str]) -> tuple[str, ...]:
    """What the fork server for a pipeline with stages of these kinds imports (a stage that
    names its own `runner` loads its kind's engine too), in one order whatever the kinds'."""
    wanted = {module for kind in kinds for module in _LOADS[kind]}
    return tuple(m for m in dict.fromkeys(m for ms in _LOADS.values() for m in ms) if m in wanted)


def load_signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a fork server started with `env` loaded under: its variables read at load."""
    return tuple(sorted((k, v) for k, v in env.items() if _read_at_load(k)))


class ForkedProcess:
    """What StageProcess uses of subprocess.Popen, for a stage the fork server forked. Its exit
    status comes from the server, which is its parent."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        self._exited = threading.Event()
        try:  # to learn of its end should the server die first
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already gone: its exit message follows
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"stage process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _outlive_server(self) -> None:
        # The server died first: this stage sees its parent go and ends itself with SIGKILL
        # (worker.end_process_tree), which is the status reported; its pidfd says when.
        if self._pidfd is not None:
            select.select([self._pidfd], [], [])
        self._exit(-signal.SIGKILL)


class ForkServerFailed(OSError):
    """The server exited or hung during its start-up: in the same environment it would again."""


class ForkServer:
    """One running fork server: its process, its socket, and the stages it forked."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]):
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_omni_plugin.stages.fork_server",
                    f"--fd={theirs.fileno()}",
                    f"--preload={','.join(preload)}",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
            )
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time: replies come in order
        # The reader hands each reply over: a forked child, the server's pid once it is ready,
        # None once it is gone.
        self._replies: queue.Queue[ForkedProcess | int | None] = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._reader = threading.Thread(target=self._read, name="omni-fork-server", daemon=True)
        self._reader.start()
        try:
            ready = self._replies.get(timeout=SERVER_READY_S)
        except queue.Empty:
            self.proc.kill()
            raise ForkServerFailed(
                f"the fork server was not ready within {SERVER_READY_S:.0f} s"
            ) from None
        if ready is None:
            raise ForkServerFailed(
                f"the fork server exited during start-up (code {self.proc.wait()})"
            )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def idle(self) -> bool:
        """No stage it forked is running."""
        return not self._children

    def close(self) -> None:
        """End the server (it exits at EOF); the stages it forked see their parent go."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass

    def fork(
        self, argv: list[str], env: dict[str, str], title: str, control_fd: int
    ) -> ForkedProcess:
        """Fork a stage running `stages.worker` with `argv` (and `--fd` of its end of the
        control socket), its stdout and stderr on a pipe read through `.stdout`."""
        read_end, write_end = os.pipe()
        request = encode(ForkStage(argv, env, os.getcwd(), title))
        try:
            with self._lock:
                socket.send_fds(self._sock, [request], [control_fd, write_end])
                child = self._replies.get(timeout=REPLY_S)
        except queue.Empty:
            os.close(read_end)
            self.proc.kill()  # a late reply would answer the next request
            raise OSError(f"the fork server did not fork within {REPLY_S:.0f} s") from None
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        if not isinstance(child, ForkedProcess):
            os.close(read_end)
            raise OSError("the fork server is gone")
        child.stdout = os.fdopen(read_end, "rb")
        return child

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_REPLY_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = fork_server_decoder.decode(data)
            if isinstance(message, StageExited):
                child = self._children.pop(message.pid, None)
                if child is not None:
                    child._exit(message.returncode)
            elif isinstance(message, Forked):
                child = self._children[message.pid] = ForkedProcess(message.pid)
                self._replies.put(child)
            elif isinstance(message, ForkServerReady):
                self._replies.put(message.pid)
        self._sock.close()
        self._replies.put(None)
        code = self.proc.wait()
        if self._children:
            logger.warning("the stages' fork server exited (code %s) before its stages", code)
        for child in list(self._children.values()):
            threading.Thread(target=child._outlive_server, daemon=True).start()


ServerKey = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]  # load_signature, preload
_servers: dict[ServerKey, ForkServer] = {}
_failed: set[ServerKey] = set()  # those whose server could not start
_servers_lock = threading.Lock()  # also one fork at a time: a fork takes milliseconds


def fork_stage(
    argv: list[str],
    env: dict[str, str],
    server_env: dict[str, str],
    preload: tuple[str, ...],
    title: str,
    control_fd: int,
) -> ForkedProcess | None:
    """The stage forked from the fork server for `server_env` that imported `preload` (started
    if none runs); None where it must start fresh instead (see the module docstring)."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return None
    differences = read_at_load_differences(env, server_env)
    if differences:
        logger.info(
            "%s starts as a fresh interpreter: its %s differ from the stages' common environment",
            title,
            ", ".join(differences),
        )
        return None
    key = (load_signature(server_env), preload)
    with _servers_lock:
        if key in _failed:
            return None
        server = _servers.get(key)
        if server is None or not server.alive:
            for other in [k for k, s in _servers.items() if not s.alive or s.idle]:
                _servers.pop(other).close()
            try:
                server = _servers[key] = ForkServer(server_env, preload)
            except OSError as exc:
                logger.warning("%s starts as a fresh interpreter: no fork server (%s)", title, exc)
                if isinstance(exc, ForkServerFailed):  # not a lack of descriptors or memory
                    _failed.add(key)
                return None
        try:
            return server.fork(argv, env, title, control_fd)
        except OSError as exc:  # it died meanwhile; the next stage starts another
            logger.warning("%s starts as a fresh interpreter: %s", title, exc)
            return None

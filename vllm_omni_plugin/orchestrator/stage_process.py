"""One stage's OS process: spawn with its devices and env, wait until ready, talk, kill.

Start-up and shutdown are synchronous (they run in executor threads); once the stage is ready,
its replies are read and its messages written on the caller's event loop without ever blocking
it (`start_reading`, see frames.py for why), and the asyncio side lives in stage_client.py.

* The child runs `vllm_omni_plugin.stages.worker`, titled `omni-stage-<id>`, in a new session:
  killing the process group also takes down anything the stage started (a vLLM EngineCore,
  its workers), so nothing is orphaned. It is forked from the stages' fork server, which
  imported torch and vLLM once (stage_fork.py), or where that cannot be, started as
  `python -m vllm_omni_plugin.stages.worker`.
* Control messages (common/messages.py, msgpack in multiprocessing.connection framing) go over
  a socket pair. When this process dies, the child reads EOF and exits; and it watches its
  parent, this process or the fork server that ends with it (common/parent_watch.py, whatever
  it is busy with, start-up included), so a SIGKILLed API server does not leave stages behind
  either.
* stdout/stderr are pumped into our stderr (prefixed) and a ring buffer whose tail goes into
  start-up errors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from ..common.channel import MessageChannel, server_channel
from ..common.exit_status import EXIT_CONFIG
from ..common.messages import Ready, Shutdown, StageInfo, ToStageMessage
from ..config.stage_init import StageInit
from ..pipelines.registry import get_pipeline
from .errors import StageConfigError, StageStartupError
from .frames import FrameReader, FrameWriter, encode_frame
from .node_protocol import AUTHKEY_ENV
from .stage_fork import ForkedProcess, fork_stage, modules_to_preload

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

LOG_TAIL_LINES = 40

# How long a stage gets to stop by itself after Shutdown before its process group is killed.
# An AR stage stops its vLLM engine core, whose multiprocess executor waits up to 5 s for its
# idle workers (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, then SIGTERM): from vLLM 0.27 they notice
# the shutdown only at their next 5 s recheck of the shared-memory queue
# (shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS), in 0.26 at that SIGTERM. 5 s here would
# cut that short and kill the stage mid-teardown; 7 s still has the API server gone in 10 s.
STOP_WAIT_S = 7.0


# The API server's own variables its stages must see wherever they run: the plugin's settings
# (VLLM_OMNI_*, OMNI_*), among them VLLM_OMNI_STAGE_PIPELINE, which the server sets for its
# stages (entry_points/patches.py, patch 7). A local stage inherits the server's whole
# environment; a stage under a Ray actor inherits its node's, plus these (ray_backend.py).
FORWARDED_PREFIXES = ("VLLM_OMNI_", "OMNI_")


def forwarded_env() -> dict[str, str]:
    """The server's variables a stage on another process tree (a Ray actor) gets too; never
    the node registry's secret (see stage_env)."""
    return {
        k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) and k != AUTHKEY_ENV
    }


def stage_env(stage: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `environ` (default: ours now), then the stage's `devices` and
    `env` from its config (None: none, which the stages' fork server starts with)."""
    env = dict(os.environ if environ is None else environ)
    # The node registry's secret stays in the processes that speak the node protocol (the API
    # server, a headless node): a stage never uses it, and vLLM warns about the unknown VLLM_*
    # name in the stage's engine.
    env.pop(AUTHKEY_ENV, None)
    devices = getattr(stage, "devices", None)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = str(devices)
    env.update({str(k): str(v) for k, v in (getattr(stage, "env", None) or {}).items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class StageProcess:
    def __init__(
        self,
        init: StageInit,
        on_message: Callable[[Any], None],
        on_exit: Callable[[StageProcess], None],
        environ: Mapping[str, str] | None = None,
    ):
        # Both callbacks run on the event loop given to `start_reading`. `environ`: what the
        # stage's environment starts from (stage_env), by default this process's now.
        self.init = init
        self.environ = environ
        self.stage_id: int = init.stage.stage_id
        self.kind: str = init.spec.kind
        self._on_message = on_message
        self._on_exit = on_exit
        self.proc: ForkedProcess | subprocess.Popen | None = None
        self.conn: MessageChannel | None = None
        self.info: StageInfo | None = None
        self.edge_address: str | None = None  # its Ready's (stages/edge_streams.py)
        self.edge_tcp_address: str | None = None  # the same, for producers on other nodes
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: FrameWriter | None = None
        self._closing = False
        self._log_thread: threading.Thread | None = None
        self._reader: FrameReader | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes this process read from the stage's control socket since it started serving."""
        return self._reader.bytes_read if self._reader is not None else 0

    @property
    def name(self) -> str:
        return f"omni-stage-{self.stage_id}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout_s: float) -> None:
        """Spawn and block until the stage says Ready. Whatever fails on the way (the spawn
        itself, the first send, an exit, the deadline) kills what was started and raises
        StageStartupError, so a caller never holds a half-started stage."""
        try:
            self._spawn()
            self.send(self.init.to_message())
            self._await_ready(timeout_s)
        except StageStartupError:
            self.kill()
            raise
        except Exception as exc:
            self.kill()
            raise self._startup_error(f"failed to start ({type(exc).__name__}: {exc})") from exc

    def _spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = stage_env(self.init.stage, self.environ)
        try:
            self.proc = fork_stage(
                [self.name],
                env,
                stage_env(None, self.environ),
                modules_to_preload(s.kind for s in get_pipeline(self.init.pipeline).stages),
                self.name,
                child_sock.fileno(),
            ) or subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_omni_plugin.stages.worker",
                    f"--fd={child_sock.fileno()}",
                    f"--parent-pid={os.getpid()}",  # the stage exits when this process dies
                    self.name,
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=[child_sock.fileno()],
                start_new_session=True,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        self.conn = server_channel(Connection(parent_sock.detach()))
        self._log_thread = threading.Thread(
            target=self._pump_logs, name=f"{self.name}-log", daemon=True
        )
        self._log_thread.start()

    def _await_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not self._wait_ready(0.2):
            code = self.proc.poll()
            if code == EXIT_CONFIG:
                raise self._startup_error("refused its engine settings", StageConfigError)
            if code is not None:
                raise self._startup_error(f"exited with code {code} during start-up")
            if time.monotonic() > deadline:
                raise self._startup_error(f"did not become ready within {timeout_s:.0f} s")

    def _startup_error(
        self, what: str, kind: type[StageStartupError] = StageStartupError
    ) -> StageStartupError:
        # The log pump may still be copying the stage's last lines: give it a moment.
        if self._log_thread is not None and self.returncode() is not None:
            self._log_thread.join(1.0)
        return kind(
            f"stage {self.stage_id} ({self.kind}) {what}. "
            f"Last lines of its log:\n" + "\n".join(self.log_tail)
        )

    def send(self, msg: ToStageMessage) -> None:
        """Send a control message (any thread); OSError when the stage is gone.

        Before `start_reading` (start-up, in its own thread) this is a plain blocking send.
        After, every write goes through the loop's FrameWriter, which never blocks the loop;
        other threads hand it their frame."""
        conn, writer, loop = self.conn, self._writer, self._loop
        if conn is None:
            raise BrokenPipeError(f"{self.name} is not running")
        if writer is None or loop is None or loop.is_closed():
            with self._send_lock:
                conn.send(msg)
            return
        frame = encode_frame(msg)
        if _on_loop(loop):
            writer.write(frame)
            return
        try:
            loop.call_soon_threadsafe(self._write_from_thread, writer, frame)
        except RuntimeError:  # the loop closed meanwhile
            raise BrokenPipeError(f"{self.name}: its event loop is closed") from None

    def _write_from_thread(self, writer: FrameWriter, frame: bytes) -> None:
        if writer is not self._writer:  # the connection closed meanwhile
            return
        try:
            writer.write(frame)
        except OSError as exc:  # no caller left to tell; a dead stage reports its own EOF
            logger.info("%s: send failed: %s", self.name, exc)

    def _wait_ready(self, timeout_s: float) -> bool:
        """True once the stage said Ready (Ready is the first message a stage sends)."""
        assert self.conn is not None and self.proc is not None
        try:
            if not self.conn.poll(timeout_s):
                return False
            msg = self.conn.recv()
        except (EOFError, OSError):  # the stage is exiting: let the caller read its code
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
            return False
        if isinstance(msg, Ready):
            self.info = msg.info
            self.edge_address = msg.edge_address or None
            self.edge_tcp_address = msg.edge_tcp_address or None
            return True
        return False

    def start_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the stage's messages on `loop` (call from the loop's thread, after start)."""
        assert self.conn is not None
        self._loop = loop
        fd = self.conn.fileno()
        os.set_blocking(fd, False)  # the loop reads what is there and writes what fits
        self._writer = FrameWriter(loop, fd)
        reader = self._reader = FrameReader(fd)
        loop.add_reader(fd, self._on_readable, reader)

    def _on_readable(self, reader: FrameReader) -> None:
        try:
            messages = reader.read()
        except Exception:  # a message outside the schema: treat the stage as broken
            logger.exception("%s sent an unreadable message", self.name)
            messages = None
        if messages is None:  # EOF: the stage died (or is being shut down by us)
            self._close_conn()
            if not self._closing:
                self._on_exit(self)
            return
        for msg in messages:
            self._on_message(msg)

    def _close_conn(self) -> None:
        """Close the control socket, first taking it off the event loop (from any thread)."""
        conn, self.conn = self.conn, None
        writer, self._writer = self._writer, None
        if conn is None:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            conn.close()
            return

        def detach() -> None:
            try:
                if writer is not None:
                    writer.close()
                loop.remove_reader(conn.fileno())
            finally:
                conn.close()

        if _on_loop(loop):
            detach()
            return
        try:
            loop.call_soon_threadsafe(detach)
        except RuntimeError:  # the loop closed meanwhile
            conn.close()

    def _pump_logs(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.log_tail.append(line)
            print(f"({self.name}) {line}", file=sys.stderr, flush=True)

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def shutdown(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Ask politely, then SIGTERM, then SIGKILL the whole process group. A stage still
        starting reads no Shutdown (it loads its model): it is killed at once."""
        self._closing = True
        if self.proc is None:
            return
        if self.proc.poll() is None and self.info is not None:
            try:
                self.send(Shutdown())
            except OSError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Kill the stage's process group (the stage and everything it started)."""
        self._closing = True
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(2.0 if sig == signal.SIGTERM else 10.0)
                # The leader is gone; grandchildren may linger in the group: SIGKILL them.
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
                continue
            break
        self._close_conn()

    def kill_now(self) -> None:
        """SIGKILL the stage's process group at once, then every process the stage started
        outside it (a stuck stage gets no SIGTERM grace: a stopped process would not act on it).
        The children are listed before the kill: once the stage is gone they are reparented
        and can no longer be found through it."""
        self._closing = True
        if self.proc is None:
            return
        import psutil  # a vLLM dependency, so on every machine that runs an orchestrator

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for child in children:
            try:
                child.kill()
            except psutil.Error:  # gone with the group already
                pass
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %s) outlived SIGKILL for 10 s", self.name, self.proc.pid)
        self._close_conn()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

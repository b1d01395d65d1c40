"""A guarded NIXL agent: every NIXL call turns failures into ConnectorError, every wait has a
deadline (NIXL itself has none: a READ from a hung peer stays "PROC" forever), and remote agents
are loaded once per peer incarnation (a restarted peer is removed and loaded again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from vllm_omni_plugin.connectors.base import ConnectorError, ConnectorTimeout, Deadline

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _import_nixl() -> Any:
    # NIXL logs INFO lines to stdout, which would mix into a server's output.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # An empty UCX_TLS makes UCX backend creation fail with a bare NIXL_ERR_BACKEND.
    if os.environ.get("UCX_TLS") == "":
        del os.environ["UCX_TLS"]
    try:
        from nixl import _api
    except Exception as e:  # ImportError, or a broken native library
        raise ConnectorError(f"NIXL is not usable in this environment: {e!r}") from e
    return _api


_construct_lock = threading.Lock()

# UCX settings our agents get unless the environment sets them. UCX reads its environment once,
# when a context is created, so they are applied only around our agent's creation (under
# _construct_lock) and then removed: other UCX users in the process keep UCX's defaults.
UCX_AGENT_DEFAULTS: dict[str, str] = {
    # Same-host READs go through the cma transport (process_vm_readv). UCX splits each one into
    # 512 KiB segments, one per progress call: 128 syscalls and progress rounds for 64 MiB. One
    # segment per 64 MiB cut the READ's CPU time ~20% here (12.1 -> 9.6 ms from huge pages).
    # A single progress call then copies up to 64 MiB (~10 ms) before serving other requests.
    "UCX_CMA_SEG_SIZE": "64m",
    # NIXL makes the UCX worker thread-safe (our caller thread + NIXL's progress thread). UCX
    # guards it with a spinlock by default: while one thread copied 64 MiB inside a progress call
    # the other spun on the lock, doubling the consumer's CPU time for a READ (22 vs 11 ms here),
    # a whole core lost on a 2-core host. A mutex puts the waiter to sleep instead.
    "UCX_USE_MT_MUTEX": "y",
}


@contextlib.contextmanager
def _ucx_defaults() -> Iterator[None]:
    added = [k for k in UCX_AGENT_DEFAULTS if k not in os.environ]
    for key in added:
        os.environ[key] = UCX_AGENT_DEFAULTS[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _create_agent(api: Any, name: str, config: Any, progress_delay_us: int) -> Any:
    """nixl_agent(name, config), but with a progress thread that sleeps between polls.

    nixl_agent hard-codes the progress thread's delay to 0 us, a busy loop: every idle agent
    burns a whole core (measured: 4.7 s CPU per 5 s idle; 0.07 s at 5-100 us). The delay is only
    reachable through the native config object that nixl_agent builds, so while constructing we
    let it build a subclass whose pthrDelay keeps our minimum. Scoped to this call, under a lock;
    if a future NIXL refuses it we fall back to its default (and say so).
    """
    bindings = getattr(api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    if progress_delay_us <= 0 or base is None or not hasattr(base, "pthrDelay"):
        with _construct_lock, _ucx_defaults():
            return api.nixl_agent(name, config)
    try:

        class _DelayedConfig(base):  # type: ignore[misc, valid-type]
            @property
            def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
                return base.pthrDelay.__get__(self)

            @pthrDelay.setter
            def pthrDelay(self, value: int) -> None:  # noqa: N802
                base.pthrDelay.__set__(self, max(int(value), progress_delay_us))

    except TypeError:
        logger.warning("NIXL progress-thread delay not settable here: its idle thread will spin")
        with _construct_lock, _ucx_defaults():
            return api.nixl_agent(name, config)
    with _construct_lock, _ucx_defaults():
        bindings.nixlAgentConfig = _DelayedConfig
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


class NixlAgent:
    def __init__(
        self, agent_name: str, backends: tuple[str, ...] = ("UCX",), progress_delay_us: int = 20
    ):
        api = _import_nixl()
        self.name = agent_name
        config = api.nixl_agent_config(
            enable_prog_thread=True,  # without it the passive side of a READ never answers
            backends=list(backends),
            # Called from the caller's thread and our reaper thread. RW lets transfer-status polls
            # run concurrently; STRICT serialises them with the progress thread (4x slower here).
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        self.agent = self.guard(
            "agent creation", _create_agent, api, agent_name, config, progress_delay_us
        )
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise ConnectorError(
                f"NIXL backend(s) {missing} not available here (UCX_TLS / plugins?)"
            )
        self._peers: dict[str, str] = {}  # remote agent name -> incarnation loaded
        self._lock = threading.Lock()
        self._stuck: list[Any] = []  # transfer handles NIXL refused to release (hung peers)

    @staticmethod
    def guard(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except ConnectorError:
            raise
        except Exception as e:
            raise ConnectorError(f"NIXL {what} failed: {e!r}") from e

    # -- memory ---------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> Any:
        return self.guard("register_memory", self.agent.register_memory, tensor)

    def deregister(self, reg: Any) -> None:
        try:
            self.agent.deregister_memory(reg)
        except Exception as e:  # freeing must never raise; a leak is logged instead
            logger.warning("NIXL deregister_memory failed: %r", e)

    def metadata(self) -> bytes:
        return self.guard("get_agent_metadata", self.agent.get_agent_metadata)

    def partial_metadata(self, reg: Any) -> bytes:
        return self.guard(
            "get_partial_agent_metadata", self.agent.get_partial_agent_metadata, reg, False
        )

    # -- peers ----------------------------------------------------------------------------
    def ensure_peer(self, name: str, incarnation: str, metadata: bytes) -> None:
        """Load the peer's metadata unless this incarnation of it is already loaded."""
        with self._lock:
            known = self._peers.get(name)
            if known == incarnation:
                return
            if known is not None:
                logger.info(
                    "NIXL peer %s restarted (incarnation %s -> %s): re-handshake",
                    name,
                    known,
                    incarnation,
                )
                self._remove(name)
            try:
                loaded = self.agent.add_remote_agent(metadata)
            except Exception:
                # NIXL may still know the name (we forgot it after a failure it did not see).
                self._remove(name)
                loaded = self.guard("add_remote_agent", self.agent.add_remote_agent, metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                raise ConnectorError(
                    f"descriptor names agent {name!r} but its metadata is {loaded!r}"
                )
            self._peers[name] = incarnation

    def load_partial(self, name: str, incarnation: str, agent_md: bytes, region_md: bytes) -> None:
        """Add the descriptors of one more registered region of an already loaded peer.

        A producer registers device payloads where they lie, and torch's caching allocator hands
        the same block out again, so a later region can have the address and length of one
        loaded before but a new key (CUDA memory gets a new one per registration; host memory
        keeps its key). NIXL cannot update a loaded descriptor and refuses with
        NIXL_ERR_NOT_ALLOWED (seen on an H200 at the 64 MiB handoff). Its only way to
        drop one is to drop the peer: so the peer is loaded afresh, then the region.
        """
        try:
            self.agent.add_remote_agent(region_md)
            return
        except Exception as e:
            if type(e).__name__ != "nixlNotAllowedError":
                raise ConnectorError(
                    f"NIXL add_remote_agent (partial metadata) failed: {e!r}"
                ) from e
        logger.info("NIXL peer %s re-registered a region at a loaded address: reloading it", name)
        self.forget_peer(name)
        self.ensure_peer(name, incarnation, agent_md)
        self.guard("add_remote_agent (partial metadata)", self.agent.add_remote_agent, region_md)

    def forget_peer(self, name: str) -> None:
        """Drop a peer after a failure so the next descriptor from it handshakes afresh."""
        with self._lock:
            if self._peers.pop(name, None) is not None:
                self._remove(name)

    def _remove(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            logger.debug("NIXL remove_remote_agent(%s): %r", name, e)

    # -- transfers ------------------------------------------------------------------------
    def read(
        self,
        local: torch.Tensor | list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        remote_mem_type: str,
        peer: str,
        notif: bytes,
        deadline: Deadline,
    ) -> None:
        """READ remote -> local, waiting at most until `deadline`.

        Raises ConnectorTimeout when the deadline passes (peer hung) and ConnectorError when the
        peer is gone. If NIXL could not cancel the READ, the exception has `local_in_use = True`:
        the local memory may still be written later and must not be reused.
        """
        local_descs = (
            self.agent.get_xfer_descs(local)
            if isinstance(local, torch.Tensor)
            else self.agent.get_xfer_descs(local, "DRAM")
        )
        remote_descs = self.agent.get_xfer_descs(remote, remote_mem_type)
        handle = self.guard(
            f"READ setup from {peer}",
            self.agent.initialize_xfer,
            "READ",
            local_descs,
            remote_descs,
            peer,
            notif,
        )
        try:
            state = self.guard(f"READ post to {peer}", self.agent.transfer, handle)
            spin_until = time.monotonic() + 0.0005
            pause = 2e-5
            while state == "PROC":
                if deadline.expired():
                    raise ConnectorTimeout(
                        f"NIXL READ from {peer} did not finish within {deadline.timeout:.3g} s "
                        "(peer hung or unreachable)"
                    )
                if time.monotonic() > spin_until:  # spin briefly, then back off to 1 ms polls
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
                state = self.guard(f"READ from {peer}", self.agent.check_xfer_state, handle)
            if state != "DONE":
                raise ConnectorError(f"NIXL READ from {peer} failed (state {state}); peer dead?")
        except ConnectorError as e:
            if not self._release_handle(handle):
                e.local_in_use = True  # type: ignore[attr-defined]
            raise
        self._release_handle(handle)

    def _release_handle(self, handle: Any) -> bool:
        try:
            handle.release()
            return True
        except Exception as e:
            # NIXL could not cancel an in-flight READ: keep the handle so it is never garbage
            # collected mid-transfer; the caller quarantines the destination memory.
            logger.warning("NIXL could not release a transfer handle: %r", e)
            self._stuck.append(handle)
            return False

    def notify(self, peer: str, message: bytes) -> None:
        self.guard(f"send_notif to {peer}", self.agent.send_notif, peer, message)

    def shutdown(self) -> None:
        """Destroy the native agent now (stops its progress thread); later calls will fail."""
        with self._lock:
            for name in list(self._peers):
                self._remove(name)
            self._peers.clear()
        self._stuck.clear()
        self.agent = None  # type: ignore[assignment]  # the last reference: its destructor runs

    def new_notifs(self) -> dict[str, list[bytes]]:
        return self.guard("get_new_notifs", self.agent.get_new_notifs)

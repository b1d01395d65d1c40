"""Shutting down a vLLM `LLM` that a test built in its own process, completely and at once.

vLLM's shutdown stops the engine-core process and closes the client's sockets, but leaves the
client's ZMQ context to the garbage collector. pyzmq's finalizer then terminates the context, and
termination waits until every socket of the context is closed. When the context and one of its
sockets become garbage in the same cycle, the collector may finalize the context first: its
socket registry (weak references) is already empty, so nothing closes the socket, and the
collection blocks inside `Context.term`. Whichever test triggered the collection then stalls
(seen: a suite worker ~15 minutes in `gc.collect()`, in a later module's setup, its stack ending
in `Context.__del__` -> `Context.destroy` -> `Context.term` with no socket left to close).
Here the context is destroyed while its client still holds it, right after the shutdown.
"""

from __future__ import annotations

OUTPUT_THREAD_JOIN_S = 30


def shut_down(llm) -> None:
    """Stop `llm`'s engine core and close its client's ZMQ context now, not in a later
    garbage collection."""
    client = llm.llm_engine.engine_core
    client.shutdown()
    # The sync client's output thread owns the output socket and closes it once it reads the
    # shutdown signal; a socket must not be closed under a thread still polling it.
    thread = getattr(client, "output_queue_thread", None)
    if thread is not None:
        thread.join(OUTPUT_THREAD_JOIN_S)
        assert not thread.is_alive(), "vLLM's output thread did not stop after shutdown"
    ctx = getattr(client, "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)

"""Start and supervise the ranks of a multi-rank diffusion engine.

The stage's own process is rank 0: it runs the DiffusionEngine the stage drives (queue,
step-level scheduler, decode). Ranks 1..N-1 are child processes (`follower.py`) with the same
engine config; each step, rank 0 sends every follower a StepPlan (the requests it admitted,
which requests step and at which index, which are still live) over the follower's stdin pipe
(msgpack structs of plans.py),
and all ranks then run the same prepare + denoise, meeting in the CFG / Ulysses collectives.
Only rank 0 decodes.

Supervision is all-or-nothing: a follower that exits makes rank 0 exit too (RANK_DIED_EXIT_CODE)
so the stage is restarted as a whole; a rank 0 that exits closes the pipes, and followers exit
on EOF (the stage's process-group kill covers one stuck in a collective).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from ..config import DiffusionEngineConfig
from ..request import RequestState
from ..scheduler import RunnerOutput, ScheduledBatch
from .cfg import RowSplitTransformer, spread_groups
from .layout import ParallelLayout
from .plans import RankInit, RankMessage, StepPlan, Stop, decode, encode, from_plan, to_plan
from .ulysses import enable_ulysses

logger = logging.getLogger(__name__)

# Exit code of a rank 0 whose follower died: the stage is restarted as a whole.
RANK_DIED_EXIT_CODE = 71
# How long ranks wait for each other in a collective (start-up included: model loads).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def layout_of(config: DiffusionEngineConfig, rank: int) -> ParallelLayout:
    return ParallelLayout(2 if config.cfg_parallel else 1, config.ulysses_degree, rank)


def rank_config(config: DiffusionEngineConfig, rank: int) -> DiffusionEngineConfig:
    """Rank r runs on the r-th visible GPU (the stage's `devices`), or on the CPU."""
    device = torch.device(config.device)
    if device.type == "cuda":
        # No CUDA graphs across ranks: a capture that falls back on one rank and not another
        # would leave the ranks in different collectives (not measured with graphs yet).
        return dataclasses.replace(config, device=f"cuda:{rank}", cuda_graphs=False)
    return config


def store_at(port: int | None, world_size: int) -> dist.TCPStore:
    """The ranks' meeting point on this host. Rank 0 (`port` None) listens on a port it holds
    from the start (port 0: the kernel picks one) and sends it to the followers, which connect.
    A port found free and released first could be taken by another process's connection
    before rank 0 listened on it."""
    leader = port is None
    return dist.TCPStore(
        "127.0.0.1",
        0 if leader else port,
        world_size,
        is_master=leader,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,
    )


def join(config: DiffusionEngineConfig, rank: int, store: dist.Store) -> ParallelLayout:
    layout = layout_of(config, rank)
    device = torch.device(rank_config(config, rank).device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=layout.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    layout.init_groups()
    return layout


def make_parallel(engine: Any, layout: ParallelLayout) -> None:
    """Turn a built engine's adapter into this rank's share of the work."""
    adapter = engine.adapter
    if not adapter.step_batched:
        raise ValueError(
            f"cfg_parallel / ulysses_degree need a step-batched family; "
            f"{type(adapter).__name__} runs whole pipelines"
        )
    module = adapter.pipe.transformer
    name = type(module).__name__
    if layout.ulysses_degree > 1:
        adapter.ulysses = enable_ulysses(
            module, layout.ulysses_degree, layout.ulysses_rank, layout.ulysses_group
        )
    wrapper = RowSplitTransformer(adapter.transformer, layout, name)
    adapter.transformer = wrapper
    adapter.forward_groups = spread_groups(layout, wrapper)


class _LeaderRunner:
    """Rank 0's runner: tells the followers what this step runs, then runs it itself."""

    def __init__(self, inner: Any, engine: Any, ranks: ParallelRanks) -> None:
        self.inner = inner
        self.engine = engine
        self.ranks = ranks
        self.adapter = inner.adapter

    def __getattr__(self, name: str) -> Any:  # the rest of ModelRunner, unchanged
        return getattr(self.inner, name)

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        sched = self.engine.scheduler
        with self.engine._lock:  # other threads may add or abort meanwhile
            live = {s.request_id for s in (*sched.running, *sched.waiting)}
        plan = StepPlan(
            new=[(to_plan(s.req), s.seed, s.do_cfg) for s in batch.prefill],
            prefill=[s.request_id for s in batch.prefill],
            denoise=[(s.request_id, s.step) for s in batch.denoise],
            live=live,
        )
        self.ranks.send(plan)
        return self.inner.run(batch)


class ParallelRanks:
    """Rank 0's handle on its followers: pipes, processes, the watcher thread."""

    def __init__(self, procs: list[subprocess.Popen], on_death: Callable[[int, int], None]):
        self.procs = procs
        self.conns = [Connection(os.dup(p.stdin.fileno()), readable=False) for p in procs]
        for p in procs:
            p.stdin.close()
        self._on_death = on_death
        self._closing = False
        self._watch = threading.Thread(target=self._watch_loop, daemon=True, name="dit-ranks")
        self._watch.start()

    def send(self, plan: RankMessage) -> None:
        data = encode(plan)
        for c in self.conns:
            c.send_bytes(data)

    def _watch_loop(self) -> None:
        while not self._closing:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._closing:
                    self._on_death(rank, code)
                    return
            time.sleep(0.2)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the followers (Stop), then the process group."""
        self._closing = True
        try:
            self.send(Stop())
        except OSError:
            pass
        for c in self.conns:
            c.close()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_stage(rank: int, code: int) -> None:
    logger.critical("diffusion rank %d exited with %s; the stage exits to be restarted", rank, code)
    logging.shutdown()
    os._exit(RANK_DIED_EXIT_CODE)


def build_engine(
    config: DiffusionEngineConfig,
    on_rank_death: Callable[[int, int], None] | None = None,
    reuse: Any = None,
) -> Any:
    """The engine a stage drives: a plain DiffusionEngine, or rank 0 of `config.world_size`
    ranks (`engine.ranks` is then the ParallelRanks; `engine.ranks.close()` stops them).

    `reuse`: an engine from an earlier call with the same world size whose follower processes
    (and process group) are taken over: they drop their engine and build this config's, which
    saves the process starts (tests switch families and layouts this way).
    """
    from ..engine import DiffusionEngine

    world = config.world_size
    if world == 1:
        return DiffusionEngine(config)
    if reuse is not None:
        ranks = reuse.ranks
        if len(ranks.procs) + 1 != world:
            raise ValueError(f"reuse: {len(ranks.procs) + 1} ranks running, {world} needed")
        reuse.ranks = None
        ranks.send(RankInit(config, None))
        layout = layout_of(config, 0)
        layout.init_groups()
    else:
        store = store_at(None, world)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "vllm_omni_plugin.diffusion.parallel.follower", str(rank)],
                stdin=subprocess.PIPE,
            )
            for rank in range(1, world)
        ]
        ranks = ParallelRanks(procs, on_rank_death or _exit_stage)
    try:
        if reuse is None:
            ranks.send(RankInit(config, store.port))
            layout = join(config, 0, store)
        engine = DiffusionEngine(rank_config(config, 0))
        make_parallel(engine, layout)
    except BaseException:
        ranks.close(timeout=2.0)
        raise
    engine.runner = _LeaderRunner(engine.runner, engine, ranks)
    engine.ranks = ranks
    return engine


def follow(conn: Connection, rank: int) -> None:
    """A follower's life: join, build the same engine, mirror rank 0's steps until told to
    stop (Stop) or rank 0 is gone (EOF); a new RankInit swaps in another engine."""
    from ..engine import DiffusionEngine

    adapter = None
    states: dict[str, RequestState] = {}
    while True:
        try:
            msg = decode(conn.recv_bytes())
        except EOFError:
            return
        if isinstance(msg, Stop):
            return
        if isinstance(msg, RankInit):
            adapter, states = None, {}
            if msg.store_port is not None:
                layout = join(msg.config, rank, store_at(msg.store_port, msg.config.world_size))
            else:
                layout = layout_of(msg.config, rank)
                layout.init_groups()
            engine = DiffusionEngine(rank_config(msg.config, rank))
            make_parallel(engine, layout)
            adapter = engine.adapter
            continue
        for planned, seed, do_cfg in msg.new:
            req = from_plan(planned)
            st = RequestState(req=req, seed=seed, do_cfg=do_cfg)
            st.generator = torch.Generator("cpu").manual_seed(seed)
            states[req.request_id] = st
        with torch.inference_mode():
            _mirror(adapter, states, msg)
        for rid in list(states):
            if rid not in msg.live:
                del states[rid]


def _mirror(adapter: Any, states: dict[str, RequestState], plan: StepPlan) -> None:
    """Run what rank 0 runs this step, failing what it fails (same inputs, same code): a
    prepare that raises drops its requests from this step's denoise, as ModelRunner does."""
    failed: set[str] = set()
    if plan.prefill:
        try:
            adapter.prepare([states[rid] for rid in plan.prefill])
        except Exception:
            logger.exception("follower prepare failed (rank 0 fails the same requests)")
            failed.update(plan.prefill)
    group = []
    for rid, step in plan.denoise:
        if rid in failed:
            continue
        s = states[rid]
        s.step = step
        group.append(s)
    if group:
        try:
            adapter.denoise(group)
        except Exception:
            logger.exception("follower denoise failed (rank 0 fails the same requests)")


def follower_main() -> None:
    logging.basicConfig(level=logging.INFO)
    conn = Connection(os.dup(sys.stdin.fileno()), writable=False)
    try:
        follow(conn, int(sys.argv[1]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

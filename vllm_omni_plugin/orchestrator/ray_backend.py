"""Stage replicas on Ray (`runtime: {backend: ray}`): placement, routing clients, restarts.

The API server is a Ray driver. For each stage it reserves one placement-group bundle per
replica (strategy SPREAD: replicas land on different nodes while there are nodes to spread
over) and starts one StageReplicaActor (ray_replica.py) in each bundle; the orchestrator sees
one ReplicaSet per stage (replicas.py), which routes each request to a replica.

A replica (actor + its stage process) that dies is restarted by Ray (`max_restarts` of the
pipeline's `runtime:`) in the same bundle, so on the same node. Here each replica's client
keeps one call (`watch`) pending on its actor: the call fails the moment the actor dies, the
client marks the replica down (its in-flight requests fail or are retried, replicas.py), then
calls `start` until the restarted actor has its stage process ready again.

Resources per replica: 1 CPU, and as many GPUs as the stage's `devices` lists (1 when unset on
a GPU platform, 0 for a stage on the CPU); Ray picks the GPUs. Payloads between stages move
over the stages' connectors (NIXL) as they do without Ray.

Streamed edges (Qwen3-Omni's thinker -> talker -> Code2Wav) run between replicas: every
replica of a stage that reads one listens on TCP on its node's address, and a request's
replicas are fixed when it starts (replicas.py `route`), so the producer's replica opens the
request's channel to the consumer's, on the same node or another, as between headless nodes.
A final stage's chunks reach this process through the actor's `submit` (a Ray streaming
generator, with the request's Progress), their Credits go back as calls. A replica that dies
fails its own requests (503) and no other; a streamed request is not retried. The request's
edge tokens reach the actors inside the Submit, over Ray's transport: a cluster whose links
others can read runs Ray with TLS.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..common.limits import RequestLimits
from ..common.messages import Chunk, Result, StageInfo, Submit
from ..config.resolve import detect_platform
from ..config.stage_init import StageInit
from .errors import StageUnavailableError
from .handle import ReplicaStats, StageState, StageStats, limits_of, pending_stats
from .pending import PendingRequests, stall_timeout_of
from .ray_auth import START_HINT, RayAuthError, use_token_auth
from .replicas import ReplicaLostError, ReplicaSet
from .stage_process import forwarded_env

logger = logging.getLogger("vllm_omni_plugin.orchestrator.ray")

RAY_NAMESPACE = "vllm-omni"
FIRST_BACKOFF_S = 1.0
RESTARTING_POLL_S = 0.5
MAX_BACKOFF_S = 30.0
PLACEMENT_TIMEOUT_S = 120.0


def uses_ray(cfg: Any) -> bool:
    """The pipeline's `runtime.backend` is ray."""
    runtime = getattr(cfg, "runtime", None)
    return runtime is not None and runtime.backend == "ray"


def replica_resources(stage: Any, platform: str) -> dict[str, float]:
    """What one replica of `stage` asks Ray for."""
    # The stage kinds that name their torch device: diffusion and Code2Wav.
    engine = getattr(stage, "diffusion", None) or getattr(stage, "code2wav", None)
    on_cpu = platform == "cpu" or (engine is not None and engine.device == "cpu")
    gpus = 0 if on_cpu else (stage.runtime.device_count or 1)
    return {"num_cpus": 1, "num_gpus": gpus}


def cluster_address(address: str) -> str:
    """The cluster `runtime.address` names: "local" (the server starts one), or the head's
    host:port ("auto": RAY_ADDRESS, else the cluster started on this host). "auto" without a
    cluster is refused (RayAuthError) with how to start one, never silently a new cluster."""
    if address != "auto":
        return address
    from ray._private.services import get_ray_address_from_environment

    try:
        found = get_ray_address_from_environment("auto", None)
    except ConnectionError:
        found = None
    if not found or found == "auto":
        raise RayAuthError(
            "runtime.address is auto but no Ray cluster runs on this host and RAY_ADDRESS is "
            "unset; " + START_HINT
        )
    return found


class RayBackend:
    """Connects to (or starts) a Ray cluster and makes each stage a ReplicaSet of actors."""

    def __init__(self, cfg: Any, startup_timeout_s: float):
        self.cfg = cfg
        self.runtime = cfg.runtime
        self.startup_timeout_s = startup_timeout_s
        self.platform = cfg.platform or detect_platform()
        self._groups: dict[int, Any] = {}
        self._connected = False

    # ---- cluster -----------------------------------------------------------------------
    async def connect(self) -> None:
        """Join the cluster at `runtime.address` (with token authentication, ray_auth.py) and
        reserve every stage's bundles."""
        await asyncio.to_thread(self._connect)

    def _connect(self) -> None:
        import ray

        kwargs: dict[str, Any] = {"namespace": RAY_NAMESPACE, "log_to_driver": True}
        if self.runtime.node_ip_address:
            kwargs["_node_ip_address"] = self.runtime.node_ip_address
        address = cluster_address(self.runtime.address)
        use_token_auth(address)  # token authentication, checked against the cluster
        if address == "local":
            logger.info("runtime.address is local: starting a private Ray cluster")
            ray.init(**kwargs)
        else:
            ray.init(address=address, **kwargs)
        self._connected = True
        logger.info("Ray cluster: %s", ray.cluster_resources())
        from ray.util.placement_group import placement_group

        for stage in self.cfg.stages:
            need = replica_resources(stage, self.platform)
            bundle = {
                "CPU": need["num_cpus"],
                **({"GPU": need["num_gpus"]} if need["num_gpus"] else {}),
            }
            group = placement_group([bundle] * stage.num_replicas, strategy="SPREAD")
            ready = group.ready()
            try:
                ray.get(ready, timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise StageUnavailableError(
                    f"stage {stage.stage_id}: the Ray cluster cannot place {stage.num_replicas} "
                    f"replica(s) of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s "
                    f"(cluster: {ray.cluster_resources()})"
                ) from None
            self._groups[stage.stage_id] = group

    def close(self) -> None:
        """Give the bundles back and disconnect (actors went with their ReplicaSets)."""
        if not self._connected:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self._groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # the cluster may be gone already
                logger.info("removing a placement group failed", exc_info=True)
        self._groups.clear()
        ray.shutdown()
        self._connected = False

    # ---- stages ------------------------------------------------------------------------
    def stage_factory(self, init: StageInit) -> ReplicaSet:
        """For Orchestrator(stage_factory=...): every stage a ReplicaSet of Ray actors."""
        n = init.stage.num_replicas
        topo = self.cfg.topology
        listens = any(topo.streams(src, init.stage.stage_id) for src in init.spec.inputs)
        replicas = [RayReplicaClient(self, init, i, listens) for i in range(n)]
        # Retrying a lost request is safe only when it consumed nothing (replicas.py).
        return ReplicaSet(
            init.stage.stage_id, init.spec.kind, replicas, retry_lost=not init.spec.inputs
        )

    def create_actor(self, init: StageInit, replica: int, edge_listener: bool) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .ray_replica import StageReplicaActor

        stage = init.stage
        need = replica_resources(stage, self.platform)
        strategy = PlacementGroupSchedulingStrategy(
            self._groups[stage.stage_id], placement_group_bundle_index=replica
        )
        actor_cls = ray.remote(StageReplicaActor).options(
            **need,
            max_restarts=self.runtime.max_restarts,
            max_task_retries=0,  # a lost request is retried (or not) by its ReplicaSet
            scheduling_strategy=strategy,
            # The actor's process gets its node's environment, not this server's: pass on what
            # the stage process must see as a local stage would (stage_process.forwarded_env).
            runtime_env={"env_vars": forwarded_env()},
        )
        return actor_cls.remote(init, replica, self.startup_timeout_s, edge_listener)


class RayReplicaClient:
    """The API server's handle on one replica (a StageHandle), backed by a Ray actor. Its own
    stall clock stays unused: the actor's StageClient runs the stage's watchdog."""

    def __init__(self, backend: RayBackend, init: StageInit, replica: int, edge_listener: bool):
        self.backend = backend
        self.init = init
        self.edge_listener = edge_listener  # the stage reads a streamed edge
        self.stage_id: int = init.stage.stage_id
        self.kind: str = init.spec.kind
        self.replica = replica
        self.state = StageState.STOPPED  # STOPPED | READY | DOWN (Ray restarts it) | CLOSED
        self.actor: Any = None
        self._info: StageInfo | None = None
        self.pid: int | None = None  # the actor's process
        self.node_ip: str | None = None
        self._edge_address: str | None = None  # its stage's TCP listener for streamed edges
        self.pending = PendingRequests(stall_timeout_of(init.stage))
        self.restarts = 0
        self.deaths = 0
        self._watcher: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()

    @property
    def name(self) -> str:
        return f"stage {self.stage_id} ({self.kind}) replica {self.replica}"

    # ---- the StageHandle face (handle.py) ------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == StageState.READY

    @property
    def load(self) -> int:
        return len(self.pending)

    def describe(self) -> StageInfo | None:
        return self._info

    def limits(self) -> RequestLimits | None:
        return limits_of(self._info)

    def stats(self) -> StageStats:
        return pending_stats(
            self.pending, self.ready, self.restarts, self.deaths, 0, self.node_ip or ""
        )

    def replica_stats(self) -> list[ReplicaStats]:
        return []

    def engine_metrics(self) -> list:
        return []

    async def inspect(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        return None

    async def start(self) -> None:
        self.actor = self.backend.create_actor(self.init, self.replica, self.edge_listener)
        await self._started()
        self._watcher = asyncio.ensure_future(self._watch())

    async def _started(self) -> None:
        started = await self.actor.start.remote()
        self._info = started["info"]
        self.pid = started["pid"]
        self.node_ip = started["node_ip"]
        self._edge_address = started["edge_address"]
        self.state = StageState.READY
        logger.info(
            "%s ready on node %s (actor pid %s, stage pid %s)",
            self.name,
            self.node_ip,
            self.pid,
            started["stage_pid"],
        )

    async def _watch(self) -> None:
        """Notice the actor's death (its pending `watch` call fails), then bring it back."""
        while self.state != StageState.CLOSED:
            try:
                await self.actor.watch.remote()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.state == StageState.CLOSED:
                    return
                self._on_death(exc)
                await self._recover()

    def _on_death(self, exc: BaseException) -> None:
        if self.state != StageState.READY:
            return
        self.state = StageState.DOWN
        self.deaths += 1
        logger.error(
            "%s on node %s died (%s); %d request(s) in flight on it; Ray restarts it",
            self.name,
            self.node_ip,
            type(exc).__name__,
            len(self.pending),
        )

    async def _recover(self) -> None:
        """Call `start` until the restarted actor has its stage ready. While Ray is still
        restarting the actor, calls fail at once: ask again soon; a start that failed (the
        stage did not come up) is retried with backoff."""
        from ray.exceptions import ActorUnavailableError

        backoff = FIRST_BACKOFF_S
        while self.state == StageState.DOWN:
            try:
                await self._started()
                self.restarts += 1
                return
            except asyncio.CancelledError:
                raise
            except ActorUnavailableError:
                await asyncio.sleep(RESTARTING_POLL_S)
            except Exception as exc:
                if self.state == StageState.CLOSED:
                    return
                logger.error("%s: restart failed (%s); retrying in %g s", self.name, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def shutdown(self) -> None:
        """Stop the replica for good (blocking, any thread)."""
        self.state = StageState.CLOSED
        if self.actor is None:
            return
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=10)
        except Exception:  # dead already, or not answering: kill it below regardless
            pass
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass
        watcher = self._watcher
        if watcher is not None:
            try:
                watcher.get_loop().call_soon_threadsafe(watcher.cancel)
            except RuntimeError:  # its loop closed meanwhile
                pass

    # ---- requests ----------------------------------------------------------------------
    streams = True

    @property
    def edge_address(self) -> str | None:
        """Its stage's TCP listener (None while it is down, or when it reads no streamed edge)."""
        return self._edge_address if self.ready else None

    def route(self, request_id: str) -> RayReplicaClient:
        return self

    def send_stream(self, msg: Any) -> None:
        """A Credit for a final stage's chunk. A replica that is down drops it: its death
        fails the request anyway."""
        if self.actor is not None and self.state == StageState.READY:
            self.actor.send_stream.remote(msg)

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        """The caller holds the stage's window: the replica's watchdog must not count it."""
        self.pending.set_waiting(request_id, waiting)
        if self.actor is not None and self.state == StageState.READY:
            self.actor.set_waiting.remote(request_id, waiting)

    async def submit(self, msg: Submit, on_progress: Any = None, on_stream: Any = None) -> Result:
        if not self.ready:
            raise StageUnavailableError(f"{self.name} is {self.state}")
        actor = self.actor
        rid = msg.request_id

        def send() -> None:
            call = asyncio.ensure_future(self._call(rid, actor.submit.remote(msg)))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

        return await self.pending.run(
            rid, send, self.cancel, f"{self.name} is unreachable", on_progress, on_stream
        )

    async def _call(self, request_id: str, replies: Any) -> None:
        """Relay the actor's Progress, text outputs and Chunks for the request, then hand its
        Result to the pending request (or fail it)."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

        try:
            async for ref in replies:
                reply = await ref
                if isinstance(reply, Result):
                    reply.metrics["replica"] = self.replica
                    self.pending.resolve(reply)
                    return
                if isinstance(reply, Chunk):
                    self.pending.stream(reply)
                else:
                    self.pending.progress(reply)
        except (RayActorError, ActorUnavailableError) as exc:
            why = f"{self.name} on {self.node_ip} died: {type(exc).__name__}"
            self.pending.fail(request_id, ReplicaLostError(why))
            return
        except StageUnavailableError as exc:  # its stage process died: the actor follows it
            cause = getattr(exc, "cause", None) or exc  # Ray's wrapper adds the remote traceback
            self.pending.fail(
                request_id, ReplicaLostError(f"{self.name} on {self.node_ip}: {cause}")
            )
            return
        except RayTaskError as exc:  # anything else the call raised: this request fails (500)
            self.pending.fail(request_id, exc)
            return
        except RayError as exc:  # Ray lost the call itself (its worker, its replies)
            why = f"{self.name} on {self.node_ip}: {type(exc).__name__}"
            self.pending.fail(request_id, ReplicaLostError(why))
            return
        except Exception as exc:
            self.pending.fail(request_id, exc)
            return
        self.pending.fail(request_id, ReplicaLostError(f"{self.name}: no result for the request"))

    def cancel(self, request_id: str) -> None:
        if self.actor is not None and self.state == StageState.READY:
            self.actor.abort.remote(request_id)

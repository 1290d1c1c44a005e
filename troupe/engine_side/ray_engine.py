"""`RayEngine`: the engine side of one data-parallel rank that runs as a Ray actor
(`data_parallel_backend="ray"`).

Ray does placement and lifecycle only. The actor runs the headless engine (`serve_headless`, the
join protocol of `troupe engine --connect`), and requests and outputs travel over ZMQ as for any
remote rank: the frontend side is an `EngineProcess(remote=True)` with this object as its launcher.

Inbox / Outbox: those of its `EngineProcess` (`EngineInput` in; `EngineOutput` out, `EngineDead` on
          a death, with Ray's cause).
Owns:     its share of the Ray session (troupe.engine_side.ray_session), its placement group, its actor.
Shutdown: every way out (normal, failed start-up, cancellation, crash) runs the same shielded
          `finally`: the EngineProcess's `EngineShutdown` and bounded wait, then `ray.kill` of the
          actor, removal of the placement group, leaving the session. Both are non-detached and
          owned by this process, so Ray removes them also if it dies without a word.

Start-up, `await tg.start(side.run)`:
1. join the Ray session (connect, or start a local cluster);
2. reserve the rank's placement group, one bundle (`rank_bundle`): the rank's CPU threads
   (`num_threads`, else `default_rank_cpus`), a GPU for `device="cuda"` (or "auto" on a cluster
   with GPUs: `rank_device`), `ray_resources`. Not placed within
   `engine_ready_timeout_s` -> `EngineStartupError` naming the missing resources (logged at once
   when no node could hold it: an autoscaler may still add one);
3. the EngineProcess binds its ROUTER (`bind_address`: `data_parallel_address` PORT + rank, or any
   port on `frontend_host`) and calls `launch`: the actor is created in the group holding all of
   its bundle, `num_cpus` = the threads (Ray sets its OMP_NUM_THREADS from them; the engine's torch threads are
   the same number) and its `serve` task started with the endpoint; then the usual handshake.

Death: `wait_gone` awaits the `serve` task: it ends when the engine exits, or raises Ray's cause
(`ActorDiedError`: killed, its node died, its constructor raised), the reason the EngineProcess
reports. The ZMQ connection dropping is a signal too, and waits briefly for this cause.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import traceback
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.config import EngineConfig
from troupe.engine.child import serve_headless
from troupe.engine_side.engine_process import EngineProcess, EngineProcessStats
from troupe.engine_side.ray_placement import (
    default_rank_cpus,
    describe_ray_error,
    fits_a_node,
    frontend_host,
    rank_bundle,
    rank_device,
    rank_resources,
    unplaced_reason,
)
from troupe.engine_side.ray_session import ray_session
from troupe.errors import EngineStartupError
from troupe.hooks import load as load_hooks
from troupe.log import trace_enabled
from troupe.messages import EngineInput, EngineOutput
from troupe.process.launch import rank_address
from troupe.process.protocol import EngineReady

log = structlog.get_logger("troupe.ray_engine")

_WILDCARDS = ("0.0.0.0", "*", "[::]")
CLEANUP_WAIT_S = 10.0  # removing an actor and a placement group: RPCs of milliseconds, unless the cluster is gone


class EngineActor:
    """What runs in the Ray worker (made a Ray actor class with `ray.remote` where it is used, so
    that importing this module needs no Ray). `max_concurrency=2`: `placement` answers while `serve`
    runs."""

    def __init__(self, engine_index: int, hooks: str | None = None) -> None:
        load_hooks(hooks).before_actor(engine_index)
        self.engine_index = engine_index

    def serve(self, endpoint: str, num_threads: int, start_timeout_s: float, log_level: str | None) -> int:
        """The headless engine of this rank, connected to `endpoint`, until the frontend stops it
        (returns its exit code) or goes away (the process exits: troupe.engine.child)."""
        return serve_headless(endpoint, self.engine_index, num_threads=num_threads, log_level=log_level,
                              start_timeout_s=start_timeout_s)

    def placement(self) -> dict[str, Any]:
        """Where this rank runs and with how many threads (for checks and `ray` debugging)."""
        import ray
        import torch

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "assigned": dict(context.get_assigned_resources())}


class RayEngine:
    """The graph's engine side for one rank on Ray (same interface as `EngineProcess`)."""

    def __init__(self, config: EngineConfig, inbox: MemoryObjectReceiveStream[EngineInput],
                 outbox: MemoryObjectSendStream[EngineOutput], *, engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index
        self.num_cpus = config.num_threads or 0  # known once the cluster was seen, if unset
        self.bundle: dict[str, float] = {}
        self.actor: Any = None  # the Ray actor handle, once launched
        self._process = EngineProcess(config, inbox, outbox, engine_index=engine_index, remote=True, launcher=self)
        self._ray: Any = None
        self._pg: Any = None
        self._serving: Any = None  # the ObjectRef of the actor's `serve` task
        self._host = "127.0.0.1"

    @property
    def ready(self) -> EngineReady:
        return self._process.ready

    @property
    def pids(self) -> list[int]:
        return []  # not processes of this host's: Ray owns them

    def statistics(self) -> EngineProcessStats:
        return self._process.statistics()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="ray_engine", engine=self.engine_index)
        status = _Started(task_status)
        try:
            async with ray_session(self.config) as ray:
                self._ray = ray
                try:
                    await self._place(ray)
                    await self._process.run(task_status=status)
                finally:
                    with anyio.move_on_after(CLEANUP_WAIT_S, shield=True) as cleanup:
                        await anyio.to_thread.run_sync(self._remove, abandon_on_cancel=True)
                    if cleanup.cancelled_caught:  # the cluster does not answer: it frees them when we leave
                        log.warning("removing the Ray actor and placement group timed out", within_s=CLEANUP_WAIT_S)
        except Exception as exc:  # before ready, whatever failed (the session, the placement) failed the start-up
            if status.done or isinstance(exc, EngineStartupError):
                raise
            raise EngineStartupError.from_cause(exc, traceback.format_exc()) from exc

    # ------------------------------------------------------------------ placement

    async def _place(self, ray: Any) -> None:
        nodes, own_node, own_ip = await anyio.to_thread.run_sync(_cluster_view, ray)
        totals = [node["Resources"] for node in nodes]
        if not self.num_cpus:
            self.num_cpus = default_rank_cpus([t.get("CPU", 0.0) for t in totals], self.config.data_parallel_size)
        self._host = frontend_host(nodes, own_node, own_ip)
        self.bundle = rank_bundle(self.num_cpus, rank_device(self.config.device, totals),
                                  rank_resources(self.config, self.engine_index))
        if not fits_a_node(self.bundle, totals):
            log.warning("no node can hold this rank's bundle now; waiting for one to join",
                        bundle=self.bundle, reason=unplaced_reason(self.bundle, totals, {}),
                        within_s=self.config.engine_ready_timeout_s)
        from ray.util.placement_group import placement_group

        name = f"troupe-rank{self.engine_index}-{secrets.token_hex(3)}"
        self._pg = await anyio.to_thread.run_sync(lambda: placement_group([self.bundle], strategy="PACK", name=name))
        timeout = self.config.engine_ready_timeout_s
        with anyio.move_on_after(timeout):
            await _result(self._pg.ready())
            log.info("placement group ready", placement_group=name, bundle=self.bundle)
            return
        nodes, _, _ = await anyio.to_thread.run_sync(_cluster_view, ray)
        available = await anyio.to_thread.run_sync(ray.available_resources)
        reason = unplaced_reason(self.bundle, [node["Resources"] for node in nodes], available)
        raise EngineStartupError(f"Ray could not place engine {self.engine_index} (bundle {self.bundle}) within "
                                 f"engine_ready_timeout_s={timeout:g} s: {reason}",
                                 cause_type="PlacementGroupUnschedulable", cause_message=reason)

    # ------------------------------------------------------------------ the launcher (client.EngineLauncher)

    @property
    def bind_address(self) -> str:
        if self.config.data_parallel_address is not None:
            return rank_address(self.config.data_parallel_address, self.engine_index)
        return f"tcp://{self._host}:*"

    async def launch(self, endpoint: str) -> None:
        target = _reachable(endpoint, self._host)
        await anyio.to_thread.run_sync(self._create_actor, target)
        log.info("Ray actor started", connect=target, num_cpus=self.num_cpus)

    def _create_actor(self, target: str) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=False)
        self.actor = _actor_class(ray).options(
            num_cpus=self.num_cpus, num_gpus=self.bundle.get("GPU", 0.0), scheduling_strategy=strategy,
            resources={name: amount for name, amount in self.bundle.items() if name not in ("CPU", "GPU")},
            max_concurrency=2, max_restarts=0, name=f"troupe-engine-{self.engine_index}-{secrets.token_hex(3)}",
        ).remote(self.engine_index, self.config.hooks)
        self._serving = self.actor.serve.remote(target, self.num_cpus, self.config.engine_ready_timeout_s,
                                                "trace" if trace_enabled() else None)

    async def wait_gone(self) -> str:
        assert self._serving is not None
        try:
            code = await _result(self._serving)
        except Exception as exc:  # ActorDiedError (killed, node gone, constructor failed), RayTaskError
            return f"the Ray actor of engine {self.engine_index} died: {describe_ray_error(exc)}"
        return f"the Ray actor of engine {self.engine_index} ended: its engine exited with code {code}"

    # ------------------------------------------------------------------ shutdown

    def _remove(self) -> None:
        """Kill the actor and remove the placement group (blocking; a worker thread). Failures are
        logged: the cluster may be gone, and then so are they."""
        ray = self._ray
        from ray.util.placement_group import remove_placement_group

        steps = [("kill the Ray actor", lambda: ray.kill(self.actor, no_restart=True), self.actor),
                 ("remove the placement group", lambda: remove_placement_group(self._pg), self._pg)]
        failed = False
        for what, step, target in steps:
            if target is None:
                continue
            try:
                step()
            except Exception as exc:
                failed = True
                log.warning(f"could not {what}", error=describe_ray_error(exc))
        if not failed:
            log.info("Ray actor and placement group removed")


class _Started:
    """A `TaskStatus` that remembers whether `started()` was called."""

    def __init__(self, inner: TaskStatus[None]) -> None:
        self._inner = inner
        self.done = False

    def started(self, value: None = None) -> None:
        self.done = True
        self._inner.started(value)


@functools.cache
def _actor_class(ray: Any) -> Any:
    """`EngineActor` as a Ray actor class, made once (Ray exports a class definition per `ray.remote`)."""
    return ray.remote(EngineActor)


def _cluster_view(ray: Any) -> tuple[list[dict[str, Any]], str, str]:
    """(alive nodes, this process's node id, this node's IP)."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    return nodes, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _reachable(endpoint: str, host: str) -> str:
    """The bound `endpoint` as the actors connect to it: a wildcard host becomes `host`."""
    scheme, _, rest = endpoint.partition("://")
    bound_host, _, port = rest.rpartition(":")
    return f"{scheme}://{host if bound_host in _WILDCARDS else bound_host}:{port}"


async def _result(ref: Any) -> Any:
    """Await a Ray ObjectRef without a thread (its future completes from Ray's own threads)."""
    return await asyncio.wrap_future(ref.future())

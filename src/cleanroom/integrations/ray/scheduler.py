"""The driver side of a cluster run: nodes, routing, attempts and the run's aggregate.

``run_on_cluster`` starts one ``NodeController`` actor per node (each checks it shares the
store, reaps what a predecessor on its node left, then resolves and verifies the baseline) and
sends each episode to the least-loaded node with a free slot. Only this side numbers attempts
(in the driver's ledger, which keeps the run's aggregate: episodes, attempts, nodes). When a
node dies under an episode, the store is asked first: a durable record (the node finished it
before it died) is the episode's result; only without one is attempt n+1 queued on another
node. If the lost node was only stalled and finishes later, its export finds the winner's record
and ends ``superseded``; the store's first-writer-wins keeps the winner's record and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cleanroom.baseline.model import Baseline
from cleanroom.batch.result import EpisodeResult, RunResult
from cleanroom.batch.runner import new_run_id
from cleanroom.core.states import EpisodeState
from cleanroom.errors import ConfigError, ManifestError
from cleanroom.integrations.ray import actor, reaper, shared_store
from cleanroom.integrations.ray.aggregate import Aggregate, cause_of, from_record, refusal
from cleanroom.integrations.ray.baseline_ref import BaselineRef
from cleanroom.integrations.ray.config import RayCluster
from cleanroom.integrations.ray.pool import Node, NodePool
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.manifest import Manifest
from cleanroom.reaper import reconcile_durable
from cleanroom.record import Outcome
from cleanroom.store import LocalStore, Store, open_store

EventHook = Callable[[str, dict[str, Any]], None]


async def run_on_cluster(
    cluster: RayCluster,
    manifests: list[Manifest],
    baseline: Baseline,
    *,
    source: str | None = None,
    store: str | Path | None = None,
    run_id: str | None = None,
    driver: str = "qemu",
    options: RunOptions | None = None,
    on_event: EventHook | None = None,
) -> RunResult:
    """Run ``manifests`` across the cluster's nodes; the same records as a local run."""
    if any(m.group is not None for m in manifests):
        raise ManifestError("groups are not supported on a Ray cluster yet: run them locally")
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"a Ray cluster run needs pip install 'cleanroom[ray]' ({exc})") from exc

    owned = not ray.is_initialized()
    if owned:
        ray.init(address=cluster.address, namespace=cluster.namespace, **dict(cluster.init))
    try:
        with Ledger() as ledger:
            opened = open_store(store)
            url = str(opened.root) if isinstance(opened, LocalStore) else str(store)
            sched = Scheduler(
                cluster, ledger, opened, url, on_event, keep=cluster.keep_nodes and not owned
            )
            return await sched.run(
                manifests, baseline, source, run_id or new_run_id(), driver, options
            )
    finally:
        if owned:
            ray.shutdown()


class Scheduler:
    """One cluster run, from starting the node actors to the run's ledger row finished."""

    def __init__(
        self,
        cluster: RayCluster,
        ledger: Ledger,
        store: Store,
        url: str,
        on_event: EventHook | None,
        *,
        keep: bool = False,
    ) -> None:
        self.cluster, self.ledger, self.store, self.url = cluster, ledger, store, url
        self.keep = keep  # the node actors outlive the run (``pool``)
        self.pool: NodePool | None = None
        self.controller_id = "ray-" + secrets.token_hex(6)
        self._on_event = on_event
        self.nodes: list[Node] = []
        self.agg = Aggregate(ledger, store, self.emit)
        self._free = asyncio.Condition()

    def emit(self, kind: str, **data: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, data)

    async def run(
        self,
        manifests: list[Manifest],
        baseline: Baseline,
        source: str | None,
        run_id: str,
        driver: str,
        options: RunOptions | None,
    ) -> RunResult:
        opts = options or RunOptions()
        marker = shared_store.mark(self.store)
        try:
            await self._start_nodes(driver, opts, marker)
            ref = BaselineRef.of(baseline, source)
            dumped = [m.model_dump(mode="json") for m in manifests]
            await self._on_nodes(lambda h: h.open_run.remote(run_id, ref, dumped))
            return await self._run(manifests, baseline, run_id, driver)
        finally:
            await self._stop_nodes(run_id)
            shared_store.unmark(self.store, marker)

    async def _run(
        self, manifests: list[Manifest], baseline: Baseline, run_id: str, driver: str
    ) -> RunResult:
        self.ledger.start_run(
            run_id,
            controller_id=self.controller_id,
            baseline=baseline.digest,
            driver=f"ray:{driver}",
            parallel=sum(n.slots for n in self.nodes),
            meta={"episodes": len(manifests), "nodes": {n.node_id: n.slots for n in self.nodes}},
        )
        result, status = RunResult(run_id), "failed"
        try:
            todo = []
            for m in manifests:
                durable = self.store.get_record(run_id, m.episode_id)
                if durable is None:
                    todo.append(m)
                else:
                    reconcile_durable(self.ledger, durable)
                    result.skipped.append(m.episode_id)
            self.emit("run_started", run_id=run_id, total=len(todo), skipped=len(result.skipped))
            async with asyncio.TaskGroup() as group:
                for m in todo:
                    group.create_task(self._episode(run_id, m, result))
            status = "completed"
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            result.leaked_envs += [
                e.episode_id
                for e in result.episodes
                if e.destroy and not e.destroy.confirmed_absent
            ]
            self.ledger.finish_run(run_id, status)
            self.emit("run_finished", run_id=run_id, status=status)
        return result

    # -- one episode: its attempts, each on the least-loaded node ----------------------------

    async def _episode(self, run_id: str, manifest: Manifest, result: RunResult) -> None:
        """One episode to its result; never raises but CancelledError (one episode's trouble,
        the ledger's included, is that episode's ``infra_error``, never the run's)."""
        try:
            done = await self._attempts(run_id, manifest)
            if done.outcome is Outcome.SUPERSEDED:  # a lost node's attempt got out after all
                self.agg.finished(run_id, done)
                record = self.store.get_record(run_id, manifest.episode_id)
                done = from_record(record) if record is not None else done
            self.agg.finished(run_id, done)
        except Exception as exc:
            error = f"unexpected {type(exc).__name__} scheduling the episode: {exc}"
            self.emit("alert", message=f"episode {manifest.episode_id}: {error}")
            done = EpisodeResult(manifest.episode_id, 0, Outcome.INFRA_ERROR, error=error)
        result.episodes.append(done)

    async def _attempts(self, run_id: str, manifest: Manifest) -> EpisodeResult:
        """Attempts on the least-loaded node until one ends or a durable record is found."""
        import ray

        eid, dumped = manifest.episode_id, manifest.model_dump(mode="json")
        attempt = self.ledger.next_attempt(run_id, eid)
        for _ in range(self.cluster.max_attempts):
            node = await self._acquire()
            if node is None:
                break
            self.ledger.episode_queued(run_id, eid, attempt)
            self.ledger.episode_state(run_id, eid, attempt, EpisodeState.PROVISIONING)
            self.ledger.event(
                "episode_routed", run_id=run_id, episode_id=eid, attempt=attempt, node=node.node_id
            )
            self.emit("episode_started", episode_id=eid, attempt=attempt, env_id=node.node_id)
            try:
                done: EpisodeResult = await node.handle.episode.remote(run_id, dumped, attempt)
            except ray.exceptions.RayActorError as exc:
                lost = self.agg.node_lost(run_id, eid, attempt, node, exc)
                if lost is not None:
                    return lost
                attempt += 1  # nothing durable: attempt n+1, elsewhere
                continue
            except ray.exceptions.RayError as exc:  # the node's call failed, not the node
                return EpisodeResult(eid, attempt, Outcome.INFRA_ERROR, error=str(cause_of(exc)))
            finally:
                await self._release(node)
            return done
        self.ledger.episode_queued(run_id, eid, attempt)  # the attempt no node was left for
        error = f"no node left to run it ({self.cluster.max_attempts} attempts at most)"
        return EpisodeResult(eid, attempt, Outcome.INFRA_ERROR, error=error)

    # -- nodes ---------------------------------------------------------------------------

    async def _acquire(self) -> Node | None:
        """The alive node with a free slot and the least load (waits for one); None if every
        node is dead."""
        async with self._free:
            while True:
                alive = [n for n in self.nodes if n.alive]
                if not alive:
                    return None
                free = [n for n in alive if n.running < n.slots]
                if free:
                    node = min(free, key=lambda n: (n.load, n.node_id))
                    node.running += 1
                    return node
                await self._free.wait()

    async def _release(self, node: Node) -> None:
        async with self._free:
            node.running -= 1
            self._free.notify_all()

    async def _start_nodes(self, driver: str, opts: RunOptions, marker: str | None) -> None:
        """Every node's actor, started (or kept from the last run) and ready: the store
        checked and a predecessor's leftovers reaped there."""
        import ray

        slots = actor.discover(self.cluster.resource, self.cluster.slots)
        if not slots:
            raise ConfigError("the Ray cluster has no alive node to run episodes on")
        pool = self.pool = NodePool(driver, self.url, opts, self.cluster.resource, self.keep)
        if self.cluster.reap_every_s is not None:
            for slot in slots:
                reaper.ensure_reaper(slot.node_id, driver, self.url, self.cluster.reap_every_s)

        async def ready(node: Node) -> Node:
            try:
                info = await node.handle.start.remote(marker)
            except ray.exceptions.RayActorError:  # a kept actor that died since: a new one
                node = pool.fresh(node.slot)
                info = await node.handle.start.remote(marker)
            reaped = list(info.reaped)
            self.emit("node_ready", node=info.node, home=info.home, pid=info.pid, reaped=reaped)
            return node

        try:
            self.nodes = list(await asyncio.gather(*(ready(n) for n in pool.nodes(slots))))
        except ray.exceptions.RayError as exc:
            raise refusal(exc) from exc

    async def _on_nodes(self, call: Callable[[Any], Any]) -> list[Any]:
        """``call`` on every node at once; the first node's refusal refuses the run."""
        import ray

        try:
            return list(await asyncio.gather(*(call(n.handle) for n in self.nodes)))
        except ray.exceptions.RayError as exc:
            raise refusal(exc) from exc

    async def _stop_nodes(self, run_id: str) -> None:
        import ray

        for node in self.nodes:
            if node.alive:
                with contextlib.suppress(ray.exceptions.RayError):
                    await node.handle.close_run.remote(run_id)
        if self.pool is not None:
            self.pool.release(self.nodes)
        self.nodes = []

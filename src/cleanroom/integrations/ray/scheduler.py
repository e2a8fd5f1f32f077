"""The driver side of a cluster run: nodes, routing, attempts and the run's aggregate.

``run_on_cluster`` starts one ``NodeController`` actor per node (each checks it shares the
store, reaps what a predecessor on its node left, then resolves and verifies the baseline) and
sends each episode to the least-loaded node with a free slot (a group whole, to one node: its
warm parent, snapshot and clones are node-local). Only this side numbers attempts
(in the driver's ledger, which keeps the run's aggregate: episodes, attempts, nodes). When a
node dies under an episode, the store is asked first: a durable record (the node finished it
before it died) is the episode's result; only without one is attempt n+1 queued on another
node. If the lost node was only stalled and finishes later, its export finds the winner's record
and ends ``superseded``; the store's first-writer-wins keeps the winner's record and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cleanroom.batch.group_report import GroupReport
from cleanroom.batch.result import EpisodeResult, RunResult
from cleanroom.batch.runner import new_run_id
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import EpisodeState, Outcome
from cleanroom.errors import BaselineNotFound, ConfigError
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.seal import NODE_CHAIN, seal_or_alert
from cleanroom.integrations.ray import actor, baseline_share, reaper, shared_store
from cleanroom.integrations.ray.aggregate import Aggregate, cause_of, from_record, refusal
from cleanroom.integrations.ray.baseline_ref import BaselineRef
from cleanroom.integrations.ray.config import RayCluster
from cleanroom.integrations.ray.connect import connected
from cleanroom.integrations.ray.pool import Node, NodePool
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.lifecycle.reaper import reconcile_durable
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
    secrets_from: str | None = None,
) -> RunResult:
    """Run ``manifests`` across the cluster's nodes; the same records as a local run.
    ``secrets_from``: the secret provider each node resolves the run's secrets with."""
    with connected(cluster, "a Ray cluster run") as (_, owned), Ledger() as ledger:
        opened = open_store(store)
        url = str(opened.root) if isinstance(opened, LocalStore) else str(store)
        sched = Scheduler(
            cluster, ledger, opened, url, on_event, keep=cluster.keep_nodes and not owned
        )
        sched.secrets_from = secrets_from
        return await sched.run(manifests, baseline, source, run_id or new_run_id(), driver, options)


def units(manifests: list[Manifest]) -> list[list[Manifest]]:
    """What goes to one node at once: each single episode, and each group whole (in manifest
    order: a group where its first member is)."""
    out: list[list[Manifest]] = []
    grouped: dict[str, list[Manifest]] = {}
    for m in manifests:
        if m.group is None:
            out.append([m])
        elif m.group.id in grouped:
            grouped[m.group.id].append(m)
        else:
            grouped[m.group.id] = [m]
            out.append(grouped[m.group.id])
    return out


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
        self.secrets_from: str | None = None  # each node's secret provider (its own host's)
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
            await self._open_run(run_id, BaselineRef.of(baseline, source), baseline, manifests)
            return await self._run(manifests, baseline, run_id, driver)
        finally:
            await self._stop_nodes(run_id)
            shared_store.unmark(self.store, marker)
            # the aggregate, naming each node's sealed part (``evidence.seal``), signed last
            seal_or_alert(self.ledger, self.store, run_id, opts.signing_key, self.emit, None)

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
            async with asyncio.TaskGroup() as tasks:
                for members in units(todo):
                    tasks.create_task(self._unit(run_id, members, result))
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
        return result.ordered([m.episode_id for m in manifests], self.store)

    # -- one unit (an episode, or a group: all its episodes on one node) and its attempts ------

    async def _unit(self, run_id: str, members: list[Manifest], result: RunResult) -> None:
        """One unit to its episodes' results; never raises but CancelledError (one episode's
        trouble, the ledger's included, is that episode's ``infra_error``, never the run's)."""
        try:
            ended = await self._attempts(run_id, members, result.groups)
        except Exception as exc:
            ended = [self._unexpected(m.episode_id, exc) for m in members]
        for done in ended:
            try:
                if done.outcome is Outcome.SUPERSEDED:  # a lost node's attempt got out after all
                    self.agg.finished(run_id, done)
                    record = self.store.get_record(run_id, done.episode_id)
                    done = from_record(record) if record is not None else done
                self.agg.finished(run_id, done)
            except Exception as exc:
                done = self._unexpected(done.episode_id, exc)
            result.episodes.append(done)

    def _unexpected(self, eid: str, exc: Exception) -> EpisodeResult:
        error = f"unexpected {type(exc).__name__} scheduling the episode: {exc}"
        self.emit("alert", message=f"episode {eid}: {error}")
        return EpisodeResult(eid, 0, Outcome.INFRA_ERROR, error=error)

    async def _attempts(
        self, run_id: str, members: list[Manifest], groups: list[GroupReport]
    ) -> list[EpisodeResult]:
        """Attempts on the least-loaded node until each member ends or has a durable record;
        after a node's death only the members with nothing durable go again (attempt n+1)."""
        import ray

        attempt = {m.episode_id: self.ledger.next_attempt(run_id, m.episode_id) for m in members}
        todo, out = list(members), list[EpisodeResult]()
        for _ in range(self.cluster.max_attempts):
            held = len(todo)
            node = await self._acquire(held)
            if node is None:
                break
            for m in todo:
                eid = m.episode_id
                self.ledger.episode_queued(run_id, eid, attempt[eid])
                self.ledger.episode_state(run_id, eid, attempt[eid], EpisodeState.PROVISIONING)
                self.ledger.event(
                    "episode_routed",
                    run_id=run_id,
                    episode_id=eid,
                    attempt=attempt[eid],
                    node=node.node_id,
                )
                self.emit(
                    "episode_started", episode_id=eid, attempt=attempt[eid], env_id=node.node_id
                )
            try:
                return out + await self._call(node, run_id, todo, attempt, groups)
            except ray.exceptions.RayActorError as exc:
                left = []
                for m in todo:
                    lost = self.agg.node_lost(
                        run_id, m.episode_id, attempt[m.episode_id], node, exc
                    )
                    if lost is None:
                        attempt[m.episode_id] += 1  # nothing durable: attempt n+1, elsewhere
                        left.append(m)
                    else:
                        out.append(lost)
                todo = left
                if not todo:
                    return out
            except ray.exceptions.RayError as exc:  # the node's call failed, not the node
                error = str(cause_of(exc))
                failed = [
                    EpisodeResult(
                        m.episode_id, attempt[m.episode_id], Outcome.INFRA_ERROR, error=error
                    )
                    for m in todo
                ]
                return out + failed
            finally:
                await self._release(node, held)
        error = f"no node left to run it ({self.cluster.max_attempts} attempts at most)"
        for m in todo:  # the attempt no node was left for
            self.ledger.episode_queued(run_id, m.episode_id, attempt[m.episode_id])
            out.append(
                EpisodeResult(m.episode_id, attempt[m.episode_id], Outcome.INFRA_ERROR, error=error)
            )
        return out

    async def _call(
        self,
        node: Node,
        run_id: str,
        members: list[Manifest],
        attempt: dict[str, int],
        groups: list[GroupReport],
    ) -> list[EpisodeResult]:
        """The node runs one episode, or one group's members together."""
        first = members[0]
        if first.group is None:
            done: EpisodeResult = await node.handle.episode.remote(
                run_id, first.model_dump(mode="json"), attempt[first.episode_id]
            )
            return [done]
        dumped = [(m.model_dump(mode="json"), attempt[m.episode_id]) for m in members]
        ended, report = await node.handle.group.remote(run_id, dumped)
        groups.append(report)
        return list(ended)

    # -- nodes ---------------------------------------------------------------------------

    async def _acquire(self, weight: int = 1) -> Node | None:
        """The alive node with a free slot and the least load (waits for one), charged
        ``weight`` slots (a group's members, at most the node's slots); None if every node is
        dead."""
        async with self._free:
            while True:
                alive = [n for n in self.nodes if n.alive]
                if not alive:
                    return None
                free = [n for n in alive if n.running < n.slots]
                if free:
                    node = min(free, key=lambda n: (n.load, n.node_id))
                    node.running += min(weight, node.slots)
                    return node
                await self._free.wait()

    async def _release(self, node: Node, weight: int = 1) -> None:
        async with self._free:
            node.running -= min(weight, node.slots)
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

        gone = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)

        async def ready(node: Node) -> Node | None:
            try:
                info = await node.handle.start.remote(marker)
            except gone:  # a kept actor that died since, or its node: a new one
                node = pool.fresh(node.slot)
                try:
                    info = await node.handle.start.remote(marker)
                except gone as exc:  # the node died since it was listed: run without it
                    pool.drop(node)
                    self.emit("alert", message=f"node {node.node_id} gone: {type(exc).__name__}")
                    return None
            reaped = list(info.reaped)
            self.emit("node_ready", node=info.node, home=info.home, pid=info.pid, reaped=reaped)
            return node

        try:
            started = await asyncio.gather(*(ready(n) for n in pool.nodes(slots)))
        except ray.exceptions.RayError as exc:
            raise refusal(exc) from exc
        self.nodes = [n for n in started if n is not None]
        if not self.nodes:
            raise ConfigError("the Ray cluster has no alive node to run episodes on")

    async def _open_run(
        self, run_id: str, ref: BaselineRef, baseline: Baseline, manifests: list[Manifest]
    ) -> None:
        """Every node resolves and verifies the baseline; if one cannot get it at all, the
        baseline's archive goes to the store (once) and the nodes are asked again."""
        dumped = [m.model_dump(mode="json") for m in manifests]
        provider = self.secrets_from
        try:
            await self._on_nodes(lambda h: h.open_run.remote(run_id, ref, dumped, provider))
        except BaselineNotFound as exc:
            self.emit("baseline_shared", baseline=baseline.digest, reason=str(exc)[:300])
            url = await asyncio.to_thread(baseline_share.publish, self.store, baseline)
            shared = dataclasses.replace(ref, archive=url)
            await self._on_nodes(lambda h: h.open_run.remote(run_id, shared, dumped, provider))

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
                    closed = await node.handle.close_run.remote(run_id)
                    if closed.chain is not None:
                        events, head = closed.chain
                        self.ledger.event(
                            NODE_CHAIN, run_id=run_id, node=node.node_id, events=events, head=head
                        )
        if self.pool is not None:
            self.pool.release(self.nodes)
        self.nodes = []

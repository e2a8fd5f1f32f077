"""``NodeController``: one node's part of a cluster run, the local lifecycle behind an actor.

It owns what is node-local — its driver, its ledger (this node's ``CLEANROOM_HOME``, the truth
about its VMs), templates and spares, its reaper — and shares only the run's store. It never
numbers attempts: the driver's scheduler sends each episode with its attempt. Plain Python (no
Ray here): ``actor`` makes it a Ray actor, and tests can drive it directly.

    node = NodeController("fake", store_url, RunOptions(parallel=2), node="n1")
    await node.start(marker)                       # store shared? reap what a predecessor left
    await node.open_run(run_id, BaselineRef.of(b), [m.model_dump(mode="json") for m in ms])
    result = await node.episode(run_id, manifest_json, attempt=1)   # one EpisodeResult
    results, report = await node.group(run_id, [(manifest_json, 1), ...])  # one group, here
    closed = await node.close_run(run_id)          # the spares nobody took; its chain sealed
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any

from cleanroom.batch.group_report import GroupReport
from cleanroom.batch.groups import run_group
from cleanroom.batch.preflight import preflight
from cleanroom.batch.result import RunResult
from cleanroom.batch.runner import Batch, Controller
from cleanroom.drivers import get_driver
from cleanroom.errors import ConfigError
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.seal import NODE_RUN, seal_or_alert
from cleanroom.evidence.secrets import provider_from
from cleanroom.host import paths
from cleanroom.integrations.ray import shared_store
from cleanroom.integrations.ray.anchor import Anchor
from cleanroom.integrations.ray.baseline_ref import BaselineRef, resolve_on_node
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.lifecycle.episode import EpisodeResult
from cleanroom.lifecycle.lease import release_spares
from cleanroom.lifecycle.reaper import reap
from cleanroom.lifecycle.verify import Verifiers
from cleanroom.store import open_store


@dataclass(frozen=True)
class NodeInfo:
    """What a node says when it starts: who it is, where its state is, what it reaped."""

    node: str
    home: str
    pid: int
    slots: int
    reaped: tuple[str, ...]


@dataclass(frozen=True)
class ClosedRun:
    """What a node says when a run closes there: the spares still present, and its part of
    the run's ledger chain as sealed in the store (events, head), or None if that failed."""

    leaked: list[str]
    chain: tuple[int, str | None] | None


class NodeController:
    """The local controller of one node: episodes in, ``EpisodeResult``s out."""

    def __init__(
        self,
        driver: str,
        store: str,
        options: RunOptions,
        *,
        node: str,
        home: str | None = None,
    ) -> None:
        if home:  # this process is the node's controller: its state lives here
            os.environ["CLEANROOM_HOME"] = home
        self.node = node
        self.controller = Controller(
            get_driver(driver), Ledger(), open_store(store), options=options
        )
        self.ctx = self.controller.context()
        self._runs: dict[str, Batch] = {}
        self.anchor = Anchor()
        self.anchor.hold()  # its node's death is this controller's: nothing starts after it

    def _alive(self) -> None:
        """Refuse new work on a node that is gone (its raylet died): start no env, no spare."""
        if self.anchor.gone():
            self.ctx.driver.keep_spares(0)
            raise ConfigError(f"node {self.node} is gone (its raylet died): nothing starts here")

    async def start(self, marker: str | None) -> NodeInfo:
        """Refuse a store this node does not share; reap what a predecessor here left."""
        shared_store.check(self.ctx.store, marker, self.node)  # type: ignore[arg-type]
        report = await reap(self.ctx.driver, self.ctx.ledger, self.ctx.store)
        return NodeInfo(
            self.node,
            str(paths.home()),
            os.getpid(),
            self.ctx.options.parallel,
            tuple(report.destroyed),
        )

    async def open_run(
        self,
        run_id: str,
        ref: BaselineRef,
        manifests: list[dict[str, Any]],
        secrets_from: str | None = None,
    ) -> str:
        """Resolve and verify the run's baseline here, run the local preflight; its digest.
        ``secrets_from``: the run's secret provider (``secrets.provider_from``), resolved on
        this node (its environment, its file, its command): no value travels through Ray."""
        self._alive()
        if run_id in self._runs:
            return self._runs[run_id].baseline.digest
        ctx = dataclasses.replace(self.ctx, secret_provider=provider_from(secrets_from))
        baseline = await asyncio.to_thread(resolve_on_node, ref, self.node, ctx.store)
        items = [Manifest.model_validate(m) for m in manifests]
        verifiers = Verifiers(ctx)
        await preflight(ctx, verifiers, items, baseline)
        ctx.driver.keep_spares(ctx.options.spare_count())
        ctx.ledger.event(NODE_RUN, run_id=run_id, node=self.node)  # its chain is this node's part
        self._runs[run_id] = Batch(ctx, verifiers, run_id, baseline, RunResult(run_id))
        return baseline.digest

    async def episode(self, run_id: str, manifest: dict[str, Any], attempt: int) -> EpisodeResult:
        """Run one attempt to its confirmed end (``Batch.episode``: never raises but cancel)."""
        self._alive()
        batch = self._batch(run_id)
        item = Manifest.model_validate(manifest)
        self.ctx.ledger.episode_queued(run_id, item.episode_id, attempt)
        await batch.episode(item, attempt)
        return self._take(batch, [], [(item.episode_id, attempt)])[0]

    async def group(
        self, run_id: str, members: list[tuple[dict[str, Any], int]]
    ) -> tuple[list[EpisodeResult], GroupReport]:
        """One group's attempts, all on this node (``run_group``: forked from one warm parent
        where the driver can fork, else the setup in each env); a result per member."""
        self._alive()
        batch = self._batch(run_id)
        items = [(Manifest.model_validate(m), attempt) for m, attempt in members]
        for item, attempt in items:
            self.ctx.ledger.episode_queued(run_id, item.episode_id, attempt)
        reports: list[GroupReport] = []
        ended: list[EpisodeResult] = []
        await run_group(
            batch.ctx, batch.gate, run_id, items, batch.baseline, batch.episode, reports, ended
        )
        keys = [(item.episode_id, attempt) for item, attempt in items]
        return self._take(batch, ended, keys), reports[0]

    def _batch(self, run_id: str) -> Batch:
        batch = self._runs.get(run_id)
        if batch is None:
            raise ConfigError(f"node {self.node}: run {run_id} was not opened here")
        return batch

    @staticmethod
    def _take(
        batch: Batch, ended: list[EpisodeResult], keys: list[tuple[str, int]]
    ) -> list[EpisodeResult]:
        """The results of ``keys`` (episode id, attempt), taken out of the batch's result."""
        found: dict[tuple[str, int], EpisodeResult] = {}
        for pool in (batch.result.episodes, ended):
            for done in list(pool):
                key = (done.episode_id, done.attempt)
                if key in keys and key not in found:
                    found[key] = done
                    pool.remove(done)
        missing = [k for k in keys if k not in found]
        assert not missing, f"Batch.episode always lands its result: {missing}"
        return [found[k] for k in keys]

    async def close_run(self, run_id: str) -> ClosedRun:
        """Destroy the spares nobody took, drop the run's staging, seal this node's part of the
        run's chain (``ledger/nodes/<node>/`` in the store)."""
        if self._runs.pop(run_id, None) is None:
            return ClosedRun([], None)
        leaked = await release_spares(self.ctx, run_id)
        shutil.rmtree(self.ctx.staging_root() / run_id, ignore_errors=True)
        ctx = self.ctx
        sealed = await asyncio.to_thread(
            seal_or_alert,
            ctx.ledger,
            ctx.store,
            run_id,
            ctx.options.signing_key,
            ctx.emit,
            self.node,
        )
        return ClosedRun(leaked, sealed)

    async def ping(self) -> str:
        return self.node

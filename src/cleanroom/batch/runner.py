"""The controller: runs manifests on fresh environments and owns the ledger and the store.

``Controller.run``: refusals and reaping (``preflight``), the run's lock (``Ledger.start_run``),
the queue (``queue_pending``), then each episode (at most ``parallel`` at once) as one
``lifecycle.Episode`` — intent, env, RUN, collect, verify, export (the record last), destroy
and confirm absent — or, for a group, its clones of one warm parent (``groups``); then the
spares nobody took. Every episode ends with exactly one ``Outcome``; none can end the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

from cleanroom.batch.groups import plan, run_group
from cleanroom.batch.preflight import preflight, queue_pending
from cleanroom.batch.result import EpisodeResult, RunResult
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Driver, Owner
from cleanroom.errors import LedgerError
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.secrets import EnvSecrets, SecretProvider
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import CreateEnv, RunContext, RunOptions
from cleanroom.lifecycle.episode import Episode, EpisodeKey
from cleanroom.lifecycle.lease import release_spares
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.verify import Verifiers
from cleanroom.store import Store

__all__ = [
    "Controller",
    "CreateEnv",
    "EpisodeResult",
    "EventHook",
    "RunOptions",
    "RunResult",
    "new_run_id",
]

EventHook = Callable[[str, dict[str, Any]], None]


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


class Controller:
    """Runs batches of manifests; one instance per process is plenty."""

    def __init__(
        self,
        driver: Driver,
        ledger: Ledger,
        store: Store,
        *,
        options: RunOptions | None = None,
        on_event: EventHook | None = None,
        secret_provider: SecretProvider | None = None,
    ) -> None:
        self.driver = driver
        self.secret_provider = secret_provider or EnvSecrets()
        self.ledger = ledger
        self.store = store
        self.options = options or RunOptions()
        self.controller_id = "ctl-" + secrets.token_hex(6)
        self.owner = Owner(self.controller_id)
        self._on_event = on_event

    def _emit(self, kind: str, **data: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, data)

    def context(self) -> RunContext:
        """What this controller's episodes may use (built per run: tests swap parts)."""
        return RunContext(
            self.driver,
            self.ledger,
            self.store,
            self.owner,
            self.options,
            self._emit,
            self.secret_provider,
        )

    async def run(
        self, manifests: list[Manifest], baseline: Baseline, *, run_id: str | None = None
    ) -> RunResult:
        """Run every manifest not yet durable in ``run_id``; returns when all have ended."""
        ctx = self.context()
        verifiers = Verifiers(ctx)
        await preflight(ctx, verifiers, manifests, baseline)
        run_id = run_id or new_run_id()
        result = RunResult(run_id)
        self.ledger.start_run(
            run_id,
            controller_id=self.controller_id,
            baseline=baseline.digest,
            driver=self.driver.name,
            parallel=self.options.parallel,
            meta={"episodes": len(manifests)},
            allow_baseline_change=self.options.allow_baseline_change,
        )
        batch = Batch(ctx, verifiers, run_id, baseline, result)
        status = "failed"
        try:  # from here on the run's lock is released on every path (finish_run)
            todo, result.skipped = queue_pending(ctx, run_id, manifests)
            self._emit("run_started", run_id=run_id, total=len(todo), skipped=len(result.skipped))
            self.driver.keep_spares(self.options.spare_count())
            singles, grouped = plan(todo)
            async with asyncio.TaskGroup() as group:
                for manifest, attempt in singles:
                    group.create_task(batch.episode(manifest, attempt))
                for members in grouped.values():
                    group.create_task(
                        run_group(
                            ctx,
                            batch.gate,
                            run_id,
                            members,
                            baseline,
                            batch.episode,
                            result.groups,
                            result.episodes,
                        )
                    )
            if batch.ledger_down is not None:
                raise LedgerError(
                    f"run {run_id} stopped: {batch.ledger_down}; {batch.unstarted} episode(s) "
                    "not started (no intent could be written); resume the run once the ledger "
                    "can be written"
                ) from batch.ledger_down
            status = "completed"
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            released = asyncio.ensure_future(release_spares(ctx, run_id))
            cancelled_now = await until_done(released)
            result.leaked_envs += (
                self._spares_left(released)
                + [
                    e.episode_id
                    for e in result.episodes
                    if e.destroy and not e.destroy.confirmed_absent
                ]
                + [leak for g in result.groups for leak in g.leaked]
            )  # a parent env, a snapshot
            shutil.rmtree(ctx.staging_root() / run_id, ignore_errors=True)
            try:
                self.ledger.finish_run(run_id, "cancelled" if cancelled_now else status)
            except LedgerError:
                if batch.ledger_down is None:
                    raise  # else the run's own LedgerError says it (the same disk)
            self._emit("run_finished", run_id=run_id, status=status)
            if cancelled_now:
                raise asyncio.CancelledError
        return result.ordered([m.episode_id for m in manifests], ctx.store)

    def _spares_left(self, released: asyncio.Future[list[str]]) -> list[str]:
        """The spares ``release_spares`` could not confirm gone (an alert if it failed)."""
        try:
            return released.result()
        except Exception as exc:  # what was destroyed is in the ledger already
            self._emit("alert", message=f"releasing the spares failed: {exc}")
            return []


class Batch:
    """One run's episodes: each waits for the gate (``parallel``), runs as an ``Episode`` and
    lands in the run's result; an episode never raises except CancelledError. Once the ledger
    could not be written (``ledger_down``: its disk full, say) no further episode starts: no
    env may exist whose intent is not durable; the run then ends with that ``LedgerError``."""

    def __init__(
        self,
        ctx: RunContext,
        verifiers: Verifiers,
        run_id: str,
        baseline: Baseline,
        result: RunResult,
    ) -> None:
        self.ctx, self.verifiers, self.run_id = ctx, verifiers, run_id
        self.baseline, self.result = baseline, result
        self.gate = asyncio.Semaphore(ctx.options.parallel)
        self.ledger_down: LedgerError | None = None
        self.unstarted = 0

    async def episode(
        self, manifest: Manifest, attempt: int, create: CreateEnv | None = None
    ) -> None:
        """One episode, start to confirmed-absent (``create``: a group clone's env)."""
        queued = time.monotonic()
        async with self.gate:
            if self.ledger_down is not None:  # intent first: it could not be written
                self.unstarted += 1
                return
            key = EpisodeKey(self.run_id, manifest.episode_id, attempt)
            episode = Episode(
                self.ctx,
                key,
                manifest,
                self.baseline,
                verifiers=self.verifiers,
                start=create,
                queue_s=time.monotonic() - queued,
            )
            try:
                async with episode:
                    await episode.provision()
                    await episode.run()
                done = episode.result
            except Exception as exc:  # the last net (the ledger failed): never the whole batch
                if isinstance(exc, LedgerError) and self.ledger_down is None:
                    self.ledger_down = exc
                done = self._lost(key, exc)
        self.result.episodes.append(done)

    def _lost(self, key: EpisodeKey, exc: Exception) -> EpisodeResult:
        """An episode whose own cleanup failed: ``infra_error``, an alert; the reaper or the
        env's hard deadline ends what it may have left."""
        eid = key.episode_id
        error = f"unexpected {type(exc).__name__} ending the episode: {exc}"
        self.ctx.emit("alert", message=f"episode {eid}: {error}", episode_id=eid)
        with contextlib.suppress(Exception):
            self.ctx.ledger.episode_finished(
                key.run_id, eid, key.attempt, outcome=Outcome.INFRA_ERROR.value, error=error
            )
        return EpisodeResult(eid, key.attempt, Outcome.INFRA_ERROR, error=error)

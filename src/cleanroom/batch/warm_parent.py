"""A group's warm parent: made, set up and saved once; cloned per episode; always cleaned up.

``WarmParent.prepare`` writes the ledger intents (snapshot, then parent env), creates the parent
(``Driver.fork_parent``), runs the setup, saves it (``Driver.fork_save``: the parent is destroyed
and confirmed absent before the snapshot is sealed). The snapshot's digest may still be being
computed then (qemu hashes its RAM file while the clones restore): ``_record_seal`` waits for it
(``Driver.fork_sealed``) and records it; ``clone`` restores one episode's env and hands it over
only once the digest is recorded, so each clone's provenance names it; a seal that failed (files
changed before they were hashed) fails every clone. ``aclose`` (idempotent, shielded) destroys a
parent still alive and deletes the snapshot's files, recording both in the ledger. The files go
as soon as every clone has been restored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time

from cleanroom.batch.group_report import GroupReport, Member
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import EpisodeState, Outcome
from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot, new_env_id, new_snapshot_id
from cleanroom.errors import CleanroomError, LaunchError, SetupError, StoreError
from cleanroom.evidence.export import export_attempt
from cleanroom.evidence.manifest import Group
from cleanroom.lifecycle.context import RunContext
from cleanroom.lifecycle.episode import EpisodeResult
from cleanroom.lifecycle.lease import EnvLease
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.snapshots import delete_snapshot

OUTPUT_TAIL = 64 * 1024  # of the setup's stdout/stderr, kept as a failed episode's diagnostics


def group_digest(setup_digest: str, snapshot_digest: str) -> str:
    canonical = json.dumps({"setup": setup_digest, "snapshot": snapshot_digest}, sort_keys=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


async def run_setup(env: Env, group: Group) -> float:
    """The group's setup command in ``env``; its duration, or SetupError on failure."""
    setup, started = group.setup, time.monotonic()
    try:
        result = await asyncio.wait_for(
            env.exec(setup.command, timeout_s=setup.timeout_s, env=setup.env, cwd=setup.cwd),
            setup.timeout_s + 30,
        )
    except TimeoutError:
        raise SetupError(f"group {group.id}: setup gave no answer in {setup.timeout_s}s") from None
    if not result.ok:
        how = "timed out" if result.timed_out else f"exit {result.exit_code}"
        if result.signal is not None:
            how = f"signal {result.signal}"
        tail = result.stderr[-800:].decode(errors="replace")
        raise SetupError(
            f"group {group.id}: setup failed ({how}); stderr tail:\n{tail}",
            result.stdout[-OUTPUT_TAIL:],
            result.stderr[-OUTPUT_TAIL:],
        )
    return time.monotonic() - started


class WarmParent:
    def __init__(
        self,
        ctx: RunContext,
        run_id: str,
        group: Group,
        members: list[Member],
        baseline: Baseline,
        report: GroupReport,
    ) -> None:
        self.ctx, self.run_id, self.group, self.members = ctx, run_id, group, members
        self.baseline, self.report = baseline, report
        self.parent: Env | None = None
        self.parent_id: str | None = None  # set once its ledger intent is written
        self.lease: EnvLease | None = None  # the parent's rows
        self.parent_closed = False
        self.started = False
        self.snap: ForkSnapshot | None = None
        self._pending = len(members)  # clones still to restore
        self._delete: asyncio.Future[None] | None = None
        self._sealed: asyncio.Future[None] | None = None  # the digest recorded

    async def prepare(self) -> ForkSnapshot:
        ctx, report = self.ctx, self.report
        self.started = True
        owner = ctx.owner.ledger_fields()
        report.snapshot_id = new_snapshot_id()
        ctx.ledger.snapshot_intent(
            report.snapshot_id,
            run_id=self.run_id,
            group_id=self.group.id,
            driver=ctx.driver.name,
            setup_digest=report.setup_digest,
            **owner,
        )
        ctx.ledger.event(
            "group_started",
            run_id=self.run_id,
            group=self.group.id,
            snapshot_id=report.snapshot_id,
            episodes=report.episodes,
            setup_digest=report.setup_digest,
        )
        ctx.emit("group_started", group=self.group.id, episodes=len(self.members))
        self.parent_id = report.parent_env = new_env_id()
        self.lease = EnvLease(ctx, self.parent_id, run_id=self.run_id)  # serves every member
        started = time.monotonic()
        sid = report.snapshot_id
        self.parent = await self.lease.start(
            self._parent_request(), lambda request: ctx.driver.fork_parent(request, sid)
        )
        setup_started = time.monotonic()
        report.timings["parent_s"] = setup_started - started
        report.timings["setup_s"] = await run_setup(self.parent, self.group)
        saving = time.monotonic()
        self.snap = await ctx.driver.fork_save(self.parent, report.snapshot_id)
        await self._close_parent()
        report.timings["snapshot_s"] = time.monotonic() - saving
        self._sealed = asyncio.ensure_future(self._record_seal(saving))
        return self.snap

    async def _record_seal(self, saving: float) -> None:
        """Wait for the snapshot's digest (hashed while clones restore), then record it."""
        ctx, report = self.ctx, self.report
        assert self.snap is not None and report.snapshot_id and self.parent_id
        try:
            self.snap = await ctx.driver.fork_sealed(self.snap)
            if self.snap.digest is None:
                raise LaunchError(f"snapshot {report.snapshot_id} was sealed without a digest")
        except (CleanroomError, OSError) as exc:
            report.classification, report.error = "fork_failed", f"{type(exc).__name__}: {exc}"
            ctx.ledger.event(
                "group_failed",
                run_id=self.run_id,
                group=self.group.id,
                classification=report.classification,
                error=report.error[-2000:],
            )
            raise
        report.timings["seal_s"] = time.monotonic() - saving
        report.snapshot = self.snap.digest
        report.digest = group_digest(report.setup_digest, self.snap.digest)
        ctx.ledger.snapshot_saved(
            report.snapshot_id,
            parent_env_id=self.parent_id,
            digest=self.snap.digest,
            group_digest=report.digest,
        )
        ctx.emit("group_ready", group=self.group.id, **report.facts())

    def _parent_request(self) -> EnvRequest:
        manifest = self.members[0][0]
        baseline = self.baseline
        o = self.ctx.options
        deadline = o.boot_timeout_s + self.group.setup.timeout_s + 120 + o.cleanup_window_s
        assert self.parent_id is not None
        return EnvRequest(
            self.parent_id,
            baseline,
            manifest.limits.merged_over(baseline.limits),
            self.ctx.owner,
            deadline,
            labels={"run_id": self.run_id, "group": self.group.id, "role": "fork-parent"},
        )

    async def clone(self, request: EnvRequest) -> Env:
        """One episode's env, restored from the snapshot (``Controller.run_episode``'s create),
        once the snapshot's digest is recorded."""
        assert self.snap is not None and self._sealed is not None
        labels = {**request.labels, "group": self.group.id}
        try:
            env = await self.ctx.driver.fork_clone(
                dataclasses.replace(request, labels=labels), self.snap
            )
            try:
                await asyncio.shield(self._sealed)
            except BaseException as exc:
                await asyncio.shield(env.aclose())
                if isinstance(exc, CleanroomError | OSError):
                    raise LaunchError(f"snapshot not sealed: {exc}") from exc
                raise
        finally:
            self._pending -= 1
            if self._pending == 0:  # every clone has its own private view of the RAM now
                self._delete = asyncio.ensure_future(self._delete_snapshot())
        env.info = dataclasses.replace(env.info, group=self.report.facts())
        self.ctx.ledger.event(
            "env_forked",
            run_id=self.run_id,
            episode_id=request.labels.get("episode_id"),
            env_id=env.env_id,
            group=self.group.id,
            snapshot_id=self.report.snapshot_id,
            group_digest=self.report.digest,
        )
        return env

    def end_members(
        self,
        ended: list[EpisodeResult],
        outcome: Outcome,
        error: str,
        exc: BaseException | None = None,
    ) -> None:
        """Give every episode of the group its outcome when the group ended before any clone."""
        ctx, store = self.ctx, self.ctx.store
        assert store is not None
        logs = {}
        if isinstance(exc, SetupError):
            logs = {"setup-stdout.log": exc.stdout, "setup-stderr.log": exc.stderr}
        for manifest, attempt in self.members:
            eid = manifest.episode_id
            ctx.emit("episode_started", episode_id=eid, attempt=attempt, env_id=self.parent_id)
            ctx.ledger.episode_state(self.run_id, eid, attempt, EpisodeState.PROVISIONING)
            final_outcome, final_error = outcome, error
            try:
                export_attempt(
                    store,
                    self.run_id,
                    manifest,
                    attempt,
                    self.parent_id or "",
                    outcome,
                    error,
                    None,
                    logs,
                )
            except StoreError as exc_:
                final_outcome, final_error = Outcome.EXPORT_FAILED, f"export failed: {exc_}"
            ctx.ledger.episode_finished(
                self.run_id, eid, attempt, outcome=final_outcome.value, error=final_error
            )
            ended.append(EpisodeResult(eid, attempt, final_outcome, error=final_error))
            ctx.emit(
                "episode_finished",
                episode_id=eid,
                attempt=attempt,
                outcome=final_outcome.value,
                reward=None,
                error=final_error,
                cleanup_ms=None,
                env_id=self.parent_id,
                destroy_attempts=None,
                confirmed_absent=None,
                timings={},
            )

    async def _close_parent(self) -> None:
        if self.parent_id is None or self.parent_closed:
            return
        self.parent_closed = True
        assert self.lease is not None
        report = await self.lease.close()
        if not report.confirmed_absent:
            self.report.leaked.append(self.parent_id)

    async def _delete_snapshot(self) -> None:
        sid = self.report.snapshot_id
        if sid is None or self.report.snapshot_deleted is not None:
            return
        gone = await delete_snapshot(self.ctx, self.run_id, sid)
        self.report.snapshot_deleted = gone
        if not gone:
            self.report.leaked.append(sid)

    async def _cleanup(self) -> None:
        await self._close_parent()
        if self._sealed is not None:
            self._sealed.cancel()  # done unless no clone was made (its hash may run on)
            await asyncio.gather(self._sealed, return_exceptions=True)
        if self._delete is not None:
            await self._delete
        await self._delete_snapshot()

    async def aclose(self) -> None:
        """Destroy the parent (if alive) and delete the snapshot, shielded; idempotent."""
        if await until_done(asyncio.ensure_future(self._cleanup())):
            raise asyncio.CancelledError

"""The controller: runs manifests on fresh environments and owns the ledger and the store.

For each episode (at most ``parallel`` at once): ledger intent -> create env -> RUN -> collect
-> export (artifacts and logs, then the record, last and atomically) -> destroy in a ``finally``
shielded from cancellation, with its own deadline -> confirm absent -> ledger. Every episode
ends with exactly one ``Outcome``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cleanroom import paths
from cleanroom.agent.session import EpisodeOutput
from cleanroom.baseline import store as baseline_store
from cleanroom.baseline.model import Baseline
from cleanroom.drivers.base import DestroyReport, Driver, Env, EnvRequest, Owner, new_env_id
from cleanroom.episode_clock import EpisodeClock
from cleanroom.episode_run import run_in_env
from cleanroom.errors import CleanroomError, DriftError, LaunchError, StoreError
from cleanroom.export import export_attempt, export_episode
from cleanroom.groups import plan, run_group
from cleanroom.ledger import Ledger
from cleanroom.manifest import Manifest, ResolvedLimits, check_groups
from cleanroom.network.egress import Egress, check_manifests, episode_policy
from cleanroom.network.qemu_args import Attachment
from cleanroom.reaper import reap, reconcile_durable
from cleanroom.record import Outcome
from cleanroom.run_result import EpisodeResult, RunResult
from cleanroom.secrets import EnvSecrets, Redactor, SecretProvider
from cleanroom.secrets import resolve as resolve_secrets
from cleanroom.shielded import until_done
from cleanroom.store import Store
from cleanroom.verify import Verifiers, verdict_label

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
CreateEnv = Callable[[EnvRequest], Awaitable[Env]]


@dataclass(frozen=True)
class RunOptions:
    parallel: int = 2
    cleanup_window_s: float = 30.0
    boot_timeout_s: float = 120.0
    collect_grace_s: float = 30.0
    staging_dir: Path | None = None  # host scratch for evidence in flight (default: home/staging)
    egress_hosts: Mapping[str, str] | None = None  # name -> address for egress proxies (tests)


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
        self.verifiers = Verifiers(
            driver,
            ledger,
            self.owner,
            boot_timeout_s=self.options.boot_timeout_s,
            cleanup_window_s=self.options.cleanup_window_s,
            emit=self._emit,
        )

    def _staging_root(self) -> Path:
        return self.options.staging_dir or paths.home() / "staging"

    def _emit(self, kind: str, **data: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, data)

    async def run(
        self, manifests: list[Manifest], baseline: Baseline, *, run_id: str | None = None
    ) -> RunResult:
        """Run every manifest not yet durable in ``run_id``; returns when all have ended."""
        try:
            baseline_store.require_intact(baseline)  # full re-hash: drift refuses the run
        except DriftError as exc:
            self._emit("drift_refused", digest=exc.digest, drifted=exc.drifted)
            raise
        names = sorted({s.name for m in manifests for s in m.secrets})
        resolve_secrets(self.secret_provider, names)  # a missing secret refuses the whole run
        self.verifiers.prepare(manifests)  # so does a missing or drifted verifier baseline
        check_manifests(manifests, baseline, self.driver)  # and network beyond the baseline's
        check_groups(manifests)  # and a group whose episodes disagree on its setup or machine
        reaped = await reap(self.driver, self.ledger, self.store)  # reconcile first
        if reaped.destroyed or reaped.failed or reaped.snapshots:
            self._emit(
                "reaped",
                destroyed=reaped.destroyed,
                failed=reaped.failed,
                snapshots=reaped.snapshots,
            )
        run_id = run_id or new_run_id()
        result = RunResult(run_id)
        self.ledger.start_run(
            run_id,
            controller_id=self.controller_id,
            baseline=baseline.digest,
            driver=self.driver.name,
            parallel=self.options.parallel,
            meta={"episodes": len(manifests)},
        )
        todo = []
        for manifest in manifests:
            durable = self.store.get_record(run_id, manifest.episode_id)
            if durable is not None:
                reconcile_durable(self.ledger, durable)  # e.g. the last controller died after it
                result.skipped.append(manifest.episode_id)
                continue
            attempt = self.ledger.next_attempt(run_id, manifest.episode_id)
            self.ledger.episode_queued(run_id, manifest.episode_id, attempt)
            todo.append((manifest, attempt))
        self._emit("run_started", run_id=run_id, total=len(todo), skipped=len(result.skipped))
        gate = asyncio.Semaphore(self.options.parallel)
        status = "failed"
        singles, grouped = plan(todo)
        try:
            async with asyncio.TaskGroup() as group:
                for manifest, attempt in singles:
                    group.create_task(
                        self._guarded(gate, run_id, manifest, attempt, baseline, result)
                    )
                for members in grouped.values():
                    group.create_task(run_group(self, gate, run_id, members, baseline, result))
            status = "completed"
        except BaseException:
            status = "cancelled"
            raise
        finally:
            result.leaked_envs = [
                e.episode_id
                for e in result.episodes
                if e.destroy and not e.destroy.confirmed_absent
            ] + [leak for g in result.groups for leak in g.leaked]  # a parent env, a snapshot
            shutil.rmtree(self._staging_root() / run_id, ignore_errors=True)
            self.ledger.finish_run(run_id, status)
            self._emit("run_finished", run_id=run_id, status=status)
        return result

    async def _guarded(
        self,
        gate: asyncio.Semaphore,
        run_id: str,
        manifest: Manifest,
        attempt: int,
        baseline: Baseline,
        result: RunResult,
        create: CreateEnv | None = None,
    ) -> None:
        queued = time.monotonic()
        async with gate:
            queue_s = time.monotonic() - queued
            episode = await self.run_episode(
                run_id, manifest, attempt, baseline, queue_s=queue_s, create=create
            )
        result.episodes.append(episode)

    async def run_episode(
        self,
        run_id: str,
        manifest: Manifest,
        attempt: int,
        baseline: Baseline,
        queue_s: float = 0.0,
        create: CreateEnv | None = None,
    ) -> EpisodeResult:
        """One episode, start to confirmed-absent. Never raises except CancelledError.

        ``create`` makes its env (default ``driver.create``; a group's clones: ``groups.py``)."""
        eid = manifest.episode_id
        limits = manifest.limits.merged_over(baseline.limits)
        env_id = new_env_id()
        clock = EpisodeClock(queue_s)
        staging = self._staging_root() / run_id / eid / str(attempt)
        outcome: Outcome = Outcome.INFRA_ERROR
        error: str | None = "not started"
        output: EpisodeOutput | None = None
        env: Env | None = None
        redactor: Redactor | None = None
        egress: Egress | None = None
        episode = EpisodeResult(eid, attempt, outcome)
        self._emit("episode_started", episode_id=eid, attempt=attempt, env_id=env_id)
        cancelled = False
        try:
            self.ledger.episode_state(run_id, eid, attempt, "PROVISIONING", env_id=env_id)
            self.ledger.env_intent(
                env_id,
                run_id=run_id,
                episode_id=eid,
                attempt=attempt,
                driver=self.driver.name,
                **self.owner.ledger_fields(),
            )
            baseline_store.quick_check(baseline)
            values = resolve_secrets(self.secret_provider, [s.name for s in manifest.secrets])
            redactor = Redactor(values)
            policy = episode_policy(baseline, manifest)
            network: Attachment | None = None
            if policy:
                egress = Egress(
                    policy,
                    ledger=self.ledger,
                    run_id=run_id,
                    episode_id=eid,
                    env_id=env_id,
                    redactor=redactor,
                    hosts=self.options.egress_hosts,
                )
                network = await egress.start()
            request = self._request(env_id, baseline, limits, run_id, eid, network)
            env = await (create or self.driver.create)(request)
            if egress is not None:
                egress.check_ready(env.hello)
            clock.lap("provision_s")
            self.ledger.env_created(env_id, **env.info.ledger_fields())
            self.ledger.env_ready(env_id)
            self._emit(
                "env_ready",
                episode_id=eid,
                env_id=env_id,
                start=env.info.start_kind,
                **clock.phases,
            )
            self.ledger.episode_state(run_id, eid, attempt, "RUNNING", env_id=env_id)
            if values:
                self.ledger.event(
                    "secrets_delivered",
                    run_id=run_id,
                    episode_id=eid,
                    env_id=env_id,
                    names=sorted(values),
                )  # names, never values
            outcome, error, output = await run_in_env(
                env,
                manifest,
                baseline,
                limits,
                staging,
                values,
                collect_grace_s=self.options.collect_grace_s,
            )
            clock.lap("run_s")
        except asyncio.CancelledError:
            cancelled = True
            outcome, error = Outcome.CANCELLED, "cancelled by the controller (Ctrl-C or SIGTERM)"
        except LaunchError as exc:
            outcome, error = Outcome.INFRA_ERROR, f"launch failed: {exc}"
        except CleanroomError as exc:
            if isinstance(exc, DriftError):
                self._emit("drift_refused", episode_id=eid, digest=exc.digest, drifted=exc.drifted)
            outcome, error = Outcome.INFRA_ERROR, f"{type(exc).__name__}: {exc}"
        except OSError as exc:
            outcome, error = Outcome.INFRA_ERROR, f"host error: {exc}"
        finish = asyncio.ensure_future(
            self._finish(
                run_id,
                manifest,
                attempt,
                baseline,
                env,
                env_id,
                staging,
                clock,
                outcome,
                error,
                output,
                episode,
                redactor,
                egress,
            )
        )
        cancelled = await until_done(finish) or cancelled
        if cancelled:
            raise asyncio.CancelledError
        return episode

    async def _finish(
        self,
        run_id: str,
        manifest: Manifest,
        attempt: int,
        baseline: Baseline,
        env: Env | None,
        env_id: str,
        staging: Path,
        clock: EpisodeClock,
        outcome: Outcome,
        error: str | None,
        output: EpisodeOutput | None,
        episode: EpisodeResult,
        redactor: Redactor | None,
        egress: Egress | None = None,
    ) -> None:
        """Export the evidence, destroy the env, write the ledger. Runs shielded."""
        eid = manifest.episode_id
        if redactor and error:
            error = redactor.redact_text(error)  # errors reach the ledger and the terminal
        try:
            self.ledger.episode_state(run_id, eid, attempt, "COLLECTING", env_id=env_id)
            diagnostics = env.diagnostics() if env is not None else {}
            facts = {
                **self.driver.describe(),
                **(_env_facts(env) if env else {}),
                **_entry_facts(baseline, output),
            }
            if egress is not None:  # the episode is over: cut its network, keep its log
                diagnostics.update(await egress.finish())
                facts["network"] = egress.summary()
            try:
                if outcome.final and output is not None:
                    if manifest.verifier is not None:
                        self.ledger.episode_state(run_id, eid, attempt, "VERIFYING", env_id=env_id)
                    verdict = await self.verifiers.verify(
                        store=self.store,
                        run_id=run_id,
                        manifest=manifest,
                        attempt=attempt,
                        baseline=baseline,
                        env=env,
                        outcome=outcome,
                        error=error,
                        output=output,
                        redactor=redactor,
                    )
                    if verdict is not None:
                        clock.lap("verify_s")
                    record = await asyncio.to_thread(  # fsyncs: keep them off the event loop
                        export_episode,
                        self.store,
                        run_id,
                        manifest,
                        attempt,
                        baseline,
                        facts,
                        env_id,
                        outcome,
                        error,
                        output,
                        diagnostics,
                        clock,
                        redactor,
                        verdict=verdict,
                    )
                    episode.record = record
                    episode.reward = record.get("reward")
                    self.ledger.episode_state(run_id, eid, attempt, "DURABLE", env_id=env_id)
                else:
                    await asyncio.to_thread(
                        export_attempt,
                        self.store,
                        run_id,
                        manifest,
                        attempt,
                        env_id,
                        outcome,
                        error,
                        output,
                        diagnostics,
                        redactor,
                    )
            except StoreError as exc:
                outcome, error = Outcome.EXPORT_FAILED, f"export failed: {exc}"
                self.ledger.event("export_failed", run_id=run_id, episode_id=eid, error=str(exc))
        finally:
            self.ledger.episode_state(run_id, eid, attempt, "DESTROYING", env_id=env_id)
            episode.destroy = await self._destroy(env, env_id, run_id, eid, attempt)
            if egress is not None:
                await egress.aclose()
            await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
            episode.outcome, episode.error = outcome, error
            self.ledger.episode_finished(
                run_id,
                eid,
                attempt,
                outcome=outcome.value,
                reward=episode.reward,
                error=error,
                verdict=verdict_label((episode.record or {}).get("verdict")),
            )
            self._emit(
                "episode_finished",
                episode_id=eid,
                attempt=attempt,
                outcome=outcome.value,
                reward=episode.reward,
                error=error,
                cleanup_ms=episode.destroy.elapsed_ms if episode.destroy else None,
                env_id=env_id,
                destroy_attempts=episode.destroy.attempts if episode.destroy else None,
                confirmed_absent=episode.destroy.confirmed_absent if episode.destroy else None,
                timings=dict(clock.phases),
            )

    def _request(
        self,
        env_id: str,
        baseline: Baseline,
        limits: ResolvedLimits,
        run_id: str,
        eid: str,
        network: Attachment | None = None,
    ) -> EnvRequest:
        o = self.options
        deadline = o.boot_timeout_s + limits.timeout_s + o.collect_grace_s + o.cleanup_window_s
        return EnvRequest(
            env_id=env_id,
            baseline=baseline,
            limits=limits,
            owner=self.owner,
            hard_deadline_s=deadline,
            labels={"run_id": run_id, "episode_id": eid},
            network=network,
        )

    async def _destroy(
        self, env: Env | None, env_id: str, run_id: str, eid: str | None, attempt: int | None
    ) -> DestroyReport:
        """Destroy with retries inside the cleanup window; alert if anything remains.

        The proof goes to the episode's ``attempts/<n>/destroy.json`` (a group's warm parent,
        ``eid`` None, has only its ledger row)."""
        self.ledger.env_destroy_started(env_id)
        start = time.monotonic()
        attempts, delay = 0, 0.05
        report = DestroyReport(env_id, False, 0, 0.0, "not attempted")
        while time.monotonic() - start < self.options.cleanup_window_s:
            attempts += 1
            try:
                remaining = self.options.cleanup_window_s - (time.monotonic() - start)
                coro = (
                    env.aclose()
                    if env is not None and attempts == 1
                    else self.driver.destroy(env_id)
                )
                report = await asyncio.wait_for(coro, max(remaining, 0.1))
            except (TimeoutError, CleanroomError, OSError) as exc:
                report = DestroyReport(env_id, False, attempts, 0.0, f"{type(exc).__name__}: {exc}")
            if report.confirmed_absent:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        elapsed_ms = (time.monotonic() - start) * 1000
        report = DestroyReport(env_id, report.confirmed_absent, attempts, elapsed_ms, report.detail)
        self.ledger.env_destroyed(
            env_id,
            confirmed_absent=report.confirmed_absent,
            cleanup_ms=elapsed_ms,
            attempts=attempts,
        )
        if not report.confirmed_absent:
            self.ledger.event(
                "env_leaked", run_id=run_id, episode_id=eid, env_id=env_id, detail=report.detail
            )
            self._emit(
                "alert",
                message=f"env {env_id} still present after cleanup window",
                env_id=env_id,
                episode_id=eid,
            )
        if eid is not None:
            with contextlib.suppress(StoreError):
                await asyncio.to_thread(
                    self.store.put_bytes,
                    run_id,
                    eid,
                    f"attempts/{attempt}/destroy.json",
                    _destroy_json(report),
                )
        return report


def _env_facts(env: Env) -> dict[str, Any]:
    return {
        "accelerator": env.info.accelerator,
        "isolation": env.info.isolation,
        "kernel": env.hello.get("kernel"),
        "agent_version": env.hello.get("agent_version"),
        "guest_boot_s": env.hello.get("boot_time_s"),
        **env.info.start_facts(),
    }


def _entry_facts(baseline: Baseline, output: EpisodeOutput | None) -> dict[str, Any]:
    """``entry_kind`` (the baseline's) and, for a function, ``worker``: ``warm`` when the
    worker had its imports done before the episode (template, boot), ``started`` if not."""
    if baseline.function is None:
        return {"entry_kind": "command"}
    worker = (output.entry if output is not None else {}).get("worker")
    return {
        "entry_kind": "function",
        "entry_function": baseline.function.function,
        "worker": worker,
    }


def _destroy_json(report: DestroyReport) -> bytes:
    import json

    return json.dumps(
        {
            "env_id": report.env_id,
            "confirmed_absent": report.confirmed_absent,
            "attempts": report.attempts,
            "cleanup_ms": round(report.elapsed_ms, 3),
            "detail": report.detail,
            "pid": os.getpid(),
        },
        indent=1,
    ).encode()

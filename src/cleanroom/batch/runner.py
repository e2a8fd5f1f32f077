"""The controller: runs manifests on fresh environments and owns the ledger and the store.

For each episode (at most ``parallel`` at once): ledger intent -> create env -> RUN -> collect
-> export (artifacts and logs, then the record, last and atomically) -> destroy in a ``finally``
shielded from cancellation, with its own deadline -> confirm absent -> ledger. Every episode
ends with exactly one ``Outcome``. Here: the run and an episode's start; before the run:
``run_start``; RUN: ``episode_run``; the rest: ``episode_finish`` (destroy: ``env_destroy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cleanroom import paths
from cleanroom.agent.session import EpisodeOutput
from cleanroom.baseline import store as baseline_store
from cleanroom.baseline.model import Baseline
from cleanroom.batch.groups import plan, run_group
from cleanroom.batch.preflight import preflight, queue_pending
from cleanroom.batch.result import EpisodeResult, RunResult
from cleanroom.drivers.base import DestroyReport, Driver, Env, EnvRequest, Owner, new_env_id
from cleanroom.errors import CleanroomError, DriftError, LaunchError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.clock import EpisodeClock
from cleanroom.lifecycle.episode import finish_episode
from cleanroom.lifecycle.lease import destroy_env, release_spares
from cleanroom.lifecycle.run import run_in_env
from cleanroom.lifecycle.shield import until_done
from cleanroom.manifest import Manifest, ResolvedLimits
from cleanroom.network.egress import Egress, episode_policy
from cleanroom.network.qemu_args import Attachment
from cleanroom.record import Outcome
from cleanroom.secrets import EnvSecrets, Redactor, SecretProvider
from cleanroom.secrets import resolve as resolve_secrets
from cleanroom.store import Store
from cleanroom.verify import Verifiers

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
    spares: int | None = None  # envs kept started ahead per shape (None: ``parallel``; 0: none)
    allow_baseline_change: bool = False  # resume a run with a baseline other than its own


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
        await preflight(self, manifests, baseline)
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
        todo = queue_pending(self, run_id, manifests, result)
        self._emit("run_started", run_id=run_id, total=len(todo), skipped=len(result.skipped))
        gate = asyncio.Semaphore(self.options.parallel)
        spares = self.options.spares
        self.driver.keep_spares(self.options.parallel if spares is None else spares)
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
            released = asyncio.ensure_future(release_spares(self, run_id))
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
            shutil.rmtree(self._staging_root() / run_id, ignore_errors=True)
            self.ledger.finish_run(run_id, "cancelled" if cancelled_now else status)
            self._emit("run_finished", run_id=run_id, status=status)
            if cancelled_now:
                raise asyncio.CancelledError
        return result

    def _spares_left(self, released: asyncio.Future[list[str]]) -> list[str]:
        """The spares ``release_spares`` could not confirm gone (an alert if it failed)."""
        try:
            return released.result()
        except Exception as exc:  # what was destroyed is in the ledger already
            self._emit("alert", message=f"releasing the spares failed: {exc}")
            return []

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
            try:
                episode = await self.run_episode(
                    run_id, manifest, attempt, baseline, queue_s=queue_s, create=create
                )
            except Exception as exc:  # the last net (the ledger failed): never the whole batch
                episode = self._lost(run_id, manifest.episode_id, attempt, exc)
        result.episodes.append(episode)

    def _lost(self, run_id: str, eid: str, attempt: int, exc: Exception) -> EpisodeResult:
        """An episode whose own cleanup failed: ``infra_error``, an alert; the reaper or the
        env's hard deadline ends what it may have left."""
        error = f"unexpected {type(exc).__name__} ending the episode: {exc}"
        self._emit("alert", message=f"episode {eid}: {error}", episode_id=eid)
        with contextlib.suppress(Exception):
            self.ledger.episode_finished(
                run_id, eid, attempt, outcome=Outcome.INFRA_ERROR.value, error=error
            )
        return EpisodeResult(eid, attempt, Outcome.INFRA_ERROR, error=error)

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
        # a spare's id if the driver has one ready (none for a group's clones or a NIC)
        spare_ok = create is None and not baseline.network
        env_id = self.driver.next_env_id(baseline, limits) if spare_ok else new_env_id()
        clock = EpisodeClock(queue_s)
        staging = self._staging_root() / run_id / eid / str(attempt)
        outcome: Outcome = Outcome.INFRA_ERROR
        error: str | None = "not started"
        output: EpisodeOutput | None = None
        env: Env | None = None
        redactor: Redactor | None = None
        egress: Egress | None = None
        episode = EpisodeResult(eid, attempt, outcome)
        crash: str | None = None  # the traceback of an exception nothing expected
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
                start=env.info.started_as,
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
        except Exception as exc:  # a bug, or guest input no boundary caught: this episode only
            outcome, error = Outcome.INFRA_ERROR, f"unexpected {type(exc).__name__}: {exc}"
            crash = traceback.format_exc()
        finish = asyncio.ensure_future(
            finish_episode(
                self,
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
                crash,
            )
        )
        cancelled = await until_done(finish) or cancelled
        if cancelled:
            raise asyncio.CancelledError
        return episode

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
        """Destroy ``env`` and confirm it absent (``env_destroy.destroy_env``); for groups too."""
        return await destroy_env(self, env, env_id, run_id, eid, attempt)

"""``Episode``: one attempt of one episode in its own env, from ledger intent to confirmed absence.

    async with Episode(ctx, key, manifest, baseline, verifiers=...) as episode:
        await episode.provision()   # ledger intent, secrets, egress, the env (EnvLease)
        await episode.run()         # a batch episode's RUN + collect (a session would interact)
    episode.result                  # exactly one Outcome

Leaving the block (normally, by an exception, by cancellation) finishes the episode, shielded
from cancellation (``shield.until_done``): whatever happened before, the evidence is verified
and exported (the record last) or the attempt kept under ``attempts/<n>/``, the env is destroyed
and confirmed absent, and the ledger's row is final. An exception is the episode's outcome
(``core.states.classify``; one nothing expected keeps its traceback as the attempt's
``logs/traceback.txt``); with ``absorb`` (batch episodes) it goes no further, so one episode
can never take a batch down. Only CancelledError always propagates, once the env is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import traceback
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any

from cleanroom.agent.connection import EpisodeOutput
from cleanroom.baseline import store as baseline_store
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.clock import EpisodeClock
from cleanroom.core.states import EpisodeState, Failure, Outcome, classify
from cleanroom.drivers.base import DestroyReport, Env, EnvRequest, new_env_id
from cleanroom.errors import (
    CleanroomError,
    DriftError,
    LaunchError,
    RecordConflict,
    StoreError,
)
from cleanroom.evidence.export import export_attempt, export_episode
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.seal import seal_or_alert
from cleanroom.evidence.secrets import Redactor
from cleanroom.evidence.secrets import resolve as resolve_secrets
from cleanroom.lifecycle.context import CreateEnv, RunContext
from cleanroom.lifecycle.lease import EnvLease
from cleanroom.lifecycle.run import run_in_env
from cleanroom.lifecycle.shield import until_done
from cleanroom.lifecycle.verify import verdict_label
from cleanroom.network.egress import Egress, episode_policy
from cleanroom.network.qemu_args import Attachment
from cleanroom.store import Store

if TYPE_CHECKING:
    from cleanroom.lifecycle.verify import Verifiers


@dataclass(frozen=True)
class EpisodeKey:
    """Which attempt of which episode of which run."""

    run_id: str
    episode_id: str
    attempt: int


@dataclass
class EpisodeResult:
    episode_id: str
    attempt: int
    outcome: Outcome
    reward: float | None = None
    error: str | None = None
    record: dict[str, Any] | None = None
    destroy: DestroyReport | None = None


class Episode:
    """One env, from ledger intent to confirmed absence: a batch episode, a group clone, or an
    interactive session (``cleanroom.sessions``: it ``conclude``s instead of ``run``).

    ``start`` makes its env (default ``driver.create``; a group's clones pass the warm parent's
    ``clone``); ``absorb``: an exception in the block becomes the outcome and is not raised."""

    def __init__(
        self,
        ctx: RunContext,
        key: EpisodeKey,
        manifest: Manifest,
        baseline: Baseline,
        *,
        verifiers: Verifiers | None = None,
        start: CreateEnv | None = None,
        queue_s: float = 0.0,
        absorb: bool = True,
    ) -> None:
        self.ctx, self.key, self.manifest, self.baseline = ctx, key, manifest, baseline
        self.verifiers, self._start, self.absorb = verifiers, start, absorb
        self.limits = manifest.limits.merged_over(baseline.limits)
        # a spare's id if the driver has one ready (none for a group's clones or a NIC)
        spare_ok = start is None and not baseline.network
        self.env_id = ctx.driver.next_env_id(baseline, self.limits) if spare_ok else new_env_id()
        self.clock = EpisodeClock(queue_s)
        self.staging = ctx.staging_root() / key.run_id / key.episode_id / str(key.attempt)
        self.state = EpisodeState.PENDING
        self.outcome: Outcome = Outcome.INFRA_ERROR
        self.error: str | None = "not started"
        self.output: EpisodeOutput | None = None
        self.crash: str | None = None  # the traceback of an exception nothing expected
        self.console: bytes | None = None  # the guest's console, if its launch failed
        self.redactor: Redactor | None = None
        self.egress: Egress | None = None
        self.secret_values: dict[str, str] = {}
        self.lease: EnvLease | None = None
        self.result = EpisodeResult(key.episode_id, key.attempt, self.outcome)
        self._finished = False
        if ctx.store is not None:  # the run's ledger chain, signed, beside its records at its end
            seal = partial(
                seal_or_alert, ctx.ledger, ctx.store, key.run_id, ctx.options.signing_key, ctx.emit
            )
            ctx.ledger.on_run_finished(key.run_id, seal)

    @property
    def env(self) -> Env | None:
        return self.lease.env if self.lease is not None else None

    def _move(self, state: EpisodeState) -> None:
        self.state = state
        k = self.key
        self.ctx.ledger.episode_state(k.run_id, k.episode_id, k.attempt, state, env_id=self.env_id)

    def _require(self, state: EpisodeState) -> None:
        if self.state is not state:
            raise CleanroomError(f"episode {self.key.episode_id} is {self.state}, not {state}")

    async def __aenter__(self) -> Episode:
        k = self.key
        self.ctx.emit(
            "episode_started", episode_id=k.episode_id, attempt=k.attempt, env_id=self.env_id
        )
        return self

    async def provision(self) -> Env:
        """Ledger intent, then secrets, egress and the env; the episode is RUNNING after."""
        self._require(EpisodeState.PENDING)
        ctx, k = self.ctx, self.key
        self._move(EpisodeState.PROVISIONING)
        self.lease = EnvLease(
            ctx,
            self.env_id,
            run_id=k.run_id,
            episode_id=k.episode_id,
            attempt=k.attempt,
            proof=f"attempts/{k.attempt}/destroy.json",
        )
        baseline_store.quick_check(self.baseline)
        names = [s.name for s in self.manifest.secrets]
        self.secret_values = resolve_secrets(ctx.secret_provider, names)
        self.redactor = Redactor(self.secret_values)
        network: Attachment | None = None
        policy = episode_policy(self.baseline, self.manifest)
        if policy:
            self.egress = Egress(
                policy,
                ledger=ctx.ledger,
                run_id=k.run_id,
                episode_id=k.episode_id,
                env_id=self.env_id,
                redactor=self.redactor,
                hosts=ctx.options.egress_hosts,
            )
            network = await self.egress.start()
        env = await self.lease.start(self._request(network), self._start)
        if self.egress is not None:
            self.egress.check_ready(env.hello)
        self.clock.lap("provision_s")
        ctx.emit(
            "env_ready",
            episode_id=k.episode_id,
            env_id=self.env_id,
            start=env.info.started_as,
            **self.clock.phases,
        )
        self._move(EpisodeState.RUNNING)
        if self.secret_values:
            ctx.ledger.event(
                "secrets_delivered",
                run_id=k.run_id,
                episode_id=k.episode_id,
                env_id=self.env_id,
                names=sorted(self.secret_values),
            )  # names, never values
        return env

    async def run(self) -> None:
        """RUN the manifest in the env and collect its answer into the outcome."""
        self._require(EpisodeState.RUNNING)
        assert self.env is not None
        answer = await run_in_env(
            self.env,
            self.manifest,
            self.baseline,
            self.limits,
            self.staging,
            self.secret_values,
            collect_grace_s=self.ctx.options.collect_grace_s,
        )
        self.conclude(*answer)

    def conclude(self, outcome: Outcome, error: str | None, output: EpisodeOutput | None) -> None:
        """End the RUNNING phase with its outcome and evidence: what ``run`` does for a batch
        episode, an interactive session does itself (its transcript as the output)."""
        self._require(EpisodeState.RUNNING)
        self.outcome, self.error, self.output = outcome, error, output
        self.clock.lap("run_s")

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is not None:
            self._fail(classify(exc))
            if isinstance(exc, LaunchError):  # no env to ask: the error carries its console
                self.console = exc.console
            if isinstance(exc, DriftError):
                self.ctx.emit(
                    "drift_refused",
                    episode_id=self.key.episode_id,
                    digest=exc.digest,
                    drifted=exc.drifted,
                )
        cancelled = await until_done(asyncio.ensure_future(self._finish()))
        if cancelled and not isinstance(exc, asyncio.CancelledError):
            raise asyncio.CancelledError
        return self.absorb and isinstance(exc, Exception)

    def _fail(self, failure: Failure) -> None:
        self.outcome, self.error = failure.outcome, failure.error
        if failure.traceback is not None:
            self.crash = failure.traceback

    def _request(self, network: Attachment | None) -> EnvRequest:
        o, k = self.ctx.options, self.key
        deadline = o.boot_timeout_s + self.limits.timeout_s + o.collect_grace_s + o.cleanup_window_s
        return EnvRequest(
            env_id=self.env_id,
            baseline=self.baseline,
            limits=self.limits,
            owner=self.ctx.owner,
            hard_deadline_s=deadline,
            labels={"run_id": k.run_id, "episode_id": k.episode_id},
            network=network,
        )

    # -- the end: collect, verify, export, destroy, ledger (runs shielded) --------------------

    async def _finish(self) -> None:
        """Export the evidence, destroy the env, write the ledger. An unexpected exception here
        ends the episode ``infra_error`` the same way; the env is destroyed whatever happened."""
        if self._finished:
            return
        self._finished = True
        self.error = _error_text(self.error, self.redactor)  # it reaches the ledger and terminal
        diagnostics: dict[str, bytes] = {}
        if self.crash is not None:
            diagnostics["traceback.txt"] = self.crash.encode("utf-8", "backslashreplace")
        try:
            self._move(EpisodeState.COLLECTING)
            env = self.env
            diagnostics.update(env.diagnostics() if env is not None else {})
            if env is None and self.console is not None:  # a boot that failed: its evidence
                diagnostics["console.log"] = self.console
            facts = {
                **self.ctx.driver.describe(),
                **(_env_facts(env) if env else {}),
                **_entry_facts(self.baseline, self.output),
            }
            if self.egress is not None:  # the episode is over: cut its network, keep its log
                diagnostics.update(await self.egress.finish())
                facts["network"] = self.egress.summary()
            try:
                await self._export(facts, diagnostics)
            except RecordConflict as exc:  # another attempt was durable first (a cluster retry)
                self.outcome, self.error = Outcome.SUPERSEDED, f"superseded: {exc}"
                self.ctx.ledger.event(
                    "episode_superseded",
                    run_id=self.key.run_id,
                    episode_id=self.key.episode_id,
                    attempt=self.key.attempt,
                )
            except StoreError as exc:
                self.outcome, self.error = Outcome.EXPORT_FAILED, f"export failed: {exc}"
                self.ctx.ledger.event(
                    "export_failed",
                    run_id=self.key.run_id,
                    episode_id=self.key.episode_id,
                    error=str(exc),
                )
        except Exception as exc:  # a bug, or guest input no boundary caught: this episode only
            if self.result.record is not None:  # durable already: the record's outcome stands
                self.ctx.emit(
                    "alert", message=f"after the record of {self.key.episode_id}: {exc!r}"
                )
            else:
                await self._keep_crash(exc, diagnostics)
        finally:
            await self._close()

    async def _export(self, facts: dict[str, Any], diagnostics: dict[str, bytes]) -> None:
        """A final outcome with output: verdict, then artifacts, logs and the record (durable);
        any other: the attempt's diagnostics under ``attempts/<n>/``."""
        k, store = self.key, self.ctx.store
        assert store is not None
        output = self.output
        if not (self.outcome.final and output is not None):
            await self._keep_attempt(store, output, diagnostics)
            return
        winner = await asyncio.to_thread(store.get_record, k.run_id, k.episode_id)
        if winner is not None and winner.get("attempt") != k.attempt:  # write nothing of ours
            raise RecordConflict(f"attempt {winner.get('attempt')} is durable already")
        verdict = None
        if self.verifiers is not None:
            if self.manifest.verifier is not None:
                self._move(EpisodeState.VERIFYING)
            verdict = await self.verifiers.verify(
                store=store,
                run_id=k.run_id,
                manifest=self.manifest,
                attempt=k.attempt,
                baseline=self.baseline,
                env=self.env,
                outcome=self.outcome,
                error=self.error,
                output=output,
                redactor=self.redactor,
            )
            if verdict is not None:
                self.clock.lap("verify_s")
        record = await asyncio.to_thread(  # fsyncs: keep them off the event loop
            export_episode,
            store,
            k.run_id,
            self.manifest,
            k.attempt,
            self.baseline,
            facts,
            self.env_id,
            self.outcome,
            self.error,
            output,
            diagnostics,
            self.clock,
            self.redactor,
            verdict=verdict,
            signing_key=self.ctx.options.signing_key,
        )
        self.result.record = record
        self.result.reward = record.get("reward")
        self._move(EpisodeState.DURABLE)

    async def _keep_crash(self, exc: Exception, diagnostics: dict[str, bytes]) -> None:
        """The outcome of an exception while finishing (``classify``: ``infra_error``), its
        traceback kept with the attempt."""
        self.outcome = Outcome.INFRA_ERROR
        self.error = _error_text(classify(exc).error, self.redactor)
        trace = "".join(traceback.format_exception(exc))
        diagnostics["traceback.txt"] = trace.encode("utf-8", "backslashreplace")
        store = self.ctx.store
        if store is None:
            return
        with contextlib.suppress(Exception):  # best effort: the traceback for the attempt
            await self._keep_attempt(store, None, diagnostics)

    async def _keep_attempt(
        self, store: Store, output: EpisodeOutput | None, diagnostics: dict[str, bytes]
    ) -> None:
        """The attempt's evidence under ``attempts/<n>/`` (not a final, durable record)."""
        k = self.key
        await asyncio.to_thread(
            export_attempt,
            store,
            k.run_id,
            self.manifest,
            k.attempt,
            self.env_id,
            self.outcome,
            self.error,
            output,
            diagnostics,
            self.redactor,
        )

    async def _close(self) -> None:
        """Destroy and confirm (the lease), cut egress, drop the staging, write the outcome."""
        ctx, k, result = self.ctx, self.key, self.result
        with contextlib.suppress(Exception):  # the ledger's state must not stop the destroy
            self._move(EpisodeState.DESTROYING)
        if self.lease is None:  # ended before its intent: no env was ever asked for
            result.destroy = DestroyReport(self.env_id, True, 0, 0.0, "never created")
        else:
            result.destroy = await self.lease.close()
        if self.egress is not None:
            await self.egress.aclose()
        await asyncio.to_thread(shutil.rmtree, self.staging, ignore_errors=True)
        result.outcome, result.error = self.outcome, self.error
        self.state = EpisodeState.CLOSED
        ctx.ledger.episode_finished(
            k.run_id,
            k.episode_id,
            k.attempt,
            outcome=self.outcome.value,
            reward=result.reward,
            error=self.error,
            verdict=verdict_label((result.record or {}).get("verdict")),
        )
        ctx.emit(
            "episode_finished",
            episode_id=k.episode_id,
            attempt=k.attempt,
            outcome=self.outcome.value,
            reward=result.reward,
            error=self.error,
            cleanup_ms=result.destroy.elapsed_ms,
            env_id=self.env_id,
            destroy_attempts=result.destroy.attempts,
            confirmed_absent=result.destroy.confirmed_absent,
            timings=dict(self.clock.phases),
        )


def _error_text(error: str | None, redactor: Redactor | None) -> str | None:
    """An error as the ledger, the record and a terminal can hold it: redacted, and valid UTF-8
    (an exception's text may hold a lone surrogate, say a file name decoded with
    ``surrogateescape``; SQLite refuses to store one)."""
    if not error:
        return error
    if redactor:
        return redactor.redact_text(error)
    return error.encode("utf-8", "backslashreplace").decode()


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

"""``EnvLease``: one env's ledger rows, written here and nowhere else, and its proof of absence.

intent (before the env exists) -> created and ready -> destroy, retried with backoff inside the
cleanup window, shielded from cancellation -> absence confirmed (or ``env_leaked`` and an
alert) -> the proof, ``destroy.json``, and its signed statement, ``destroy.dsse.json``
(``evidence.statements``), in the episode's store folder when it has one (one the store cannot
take, or a key that cannot sign, is ``destroy_proof_failed`` and an alert, never a lost
close). Batch episodes, group clones and warm parents, verifiers and the isolation check all
hold their envs this way. Also the end of a run's spares (envs started ahead that no episode took).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import PurePosixPath
from types import TracebackType

from cleanroom.drivers.base import DestroyReport, Env, EnvRequest
from cleanroom.errors import CleanroomError, EvidenceError, ExportError, LedgerError, StoreError
from cleanroom.evidence import attest, keys
from cleanroom.evidence.attest import DESTROY_ENVELOPE
from cleanroom.evidence.statements import destroy_statement
from cleanroom.lifecycle.context import CreateEnv, RunContext
from cleanroom.lifecycle.shield import until_done
from cleanroom.store.base import export_error


class EnvLease:
    """An env from its ledger intent (written on construction) to its confirmed absence.

    ``episode_id``/``attempt`` are None for an env that serves many episodes (a group's warm
    parent); ``proof`` is the store path of ``destroy.json`` (None: the ledger row only)."""

    def __init__(
        self,
        ctx: RunContext,
        env_id: str,
        *,
        run_id: str,
        episode_id: str | None = None,
        attempt: int | None = None,
        proof: str | None = None,
    ) -> None:
        self.ctx, self.env_id, self.run_id = ctx, env_id, run_id
        self.episode_id, self.attempt, self.proof = episode_id, attempt, proof
        self.env: Env | None = None
        self._closing: asyncio.Future[DestroyReport] | None = None
        ctx.ledger.env_intent(
            env_id,
            run_id=run_id,
            episode_id=episode_id,
            attempt=attempt,
            driver=ctx.driver.name,
            **ctx.owner.ledger_fields(),
        )

    async def start(self, request: EnvRequest, create: CreateEnv | None = None) -> Env:
        """Create the env (``create``, default ``driver.create``) and record it ready."""
        self.env = await (create or self.ctx.driver.create)(request)
        self.ctx.ledger.env_created(self.env_id, **self.env.info.ledger_fields())
        self.ctx.ledger.env_ready(self.env_id)
        return self.env

    @property
    def report(self) -> DestroyReport | None:
        """The destroy's report, once ``close`` has finished."""
        done = self._closing is not None and self._closing.done()
        return self._closing.result() if done and self._closing is not None else None

    async def close(self) -> DestroyReport:
        """Destroy and confirm absent, shielded (the destroy finishes even if we are
        cancelled; then CancelledError). Idempotent: every call gets the one report."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._destroy())
        if await until_done(self._closing):
            raise asyncio.CancelledError
        return self._closing.result()

    async def __aenter__(self) -> EnvLease:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _destroy(self) -> DestroyReport:
        ctx = self.ctx
        window = ctx.options.cleanup_window_s
        with contextlib.suppress(LedgerError):  # the ledger must not stop the destroy
            ctx.ledger.env_destroy_started(self.env_id)
        start = time.monotonic()
        attempts, delay = 0, 0.05
        report = DestroyReport(self.env_id, False, 0, 0.0, "not attempted")
        while time.monotonic() - start < window:
            attempts += 1
            try:
                remaining = window - (time.monotonic() - start)
                env = self.env
                coro = env.aclose() if env is not None and attempts == 1 else None
                report = await asyncio.wait_for(
                    coro or ctx.driver.destroy(self.env_id), max(remaining, 0.1)
                )
            except (TimeoutError, CleanroomError, OSError) as exc:
                detail = f"{type(exc).__name__}: {exc}"
                report = DestroyReport(self.env_id, False, attempts, 0.0, detail)
            if report.confirmed_absent:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        elapsed_ms = (time.monotonic() - start) * 1000
        report = DestroyReport(
            self.env_id, report.confirmed_absent, attempts, elapsed_ms, report.detail
        )
        ctx.ledger.env_destroyed(
            self.env_id,
            confirmed_absent=report.confirmed_absent,
            cleanup_ms=elapsed_ms,
            attempts=attempts,
        )
        if not report.confirmed_absent:
            ctx.ledger.event(
                "env_leaked",
                run_id=self.run_id,
                episode_id=self.episode_id,
                env_id=self.env_id,
                detail=report.detail,
            )
            ctx.emit(
                "alert",
                message=f"env {self.env_id} still present after cleanup window",
                env_id=self.env_id,
                episode_id=self.episode_id,
            )
        await self._write_proof(report)
        return report

    async def _write_proof(self, report: DestroyReport) -> None:
        """``destroy.json`` in the episode's store folder. A store that cannot take it (its
        ``StoreError``; an ``OSError``, a full disk, becomes an ``ExportError`` naming the
        proof) does not stop the close: the ledger row holds the confirmation already, and
        the failure is recorded (``destroy_proof_failed``) and alerted."""
        store, eid = self.ctx.store, self.episode_id
        if store is None or eid is None or self.proof is None:
            return
        where = f"the destroy proof {self.proof} of episode {eid} (run {self.run_id})"
        proof = _destroy_json(report)
        try:
            await asyncio.to_thread(store.put_bytes, self.run_id, eid, self.proof, proof)
            envelope = self._sign_proof(eid, self.proof, proof, report)
            where = f"the signed destroy statement of episode {eid} (run {self.run_id})"
            rel = str(PurePosixPath(self.proof).with_name(DESTROY_ENVELOPE))
            await asyncio.to_thread(store.put_bytes, self.run_id, eid, rel, envelope)
        except EvidenceError as exc:
            self._proof_failed(ExportError(f"cannot sign {where}: {exc}"))
        except StoreError as exc:
            self._proof_failed(ExportError(f"cannot write {where}: {exc}"))
        except OSError as exc:
            self._proof_failed(export_error(exc, where))

    def _sign_proof(self, eid: str, path: str, proof: bytes, report: DestroyReport) -> bytes:
        """The destroy statement (``evidence.statements``) over ``proof``, signed."""
        stmt = destroy_statement(
            path,
            proof,
            run_id=self.run_id,
            episode_id=eid,
            attempt=self.attempt,
            env_id=self.env_id,
            confirmed_absent=report.confirmed_absent,
        )
        return attest.sign(stmt, keys.signing_key(self.ctx.options.signing_key))

    def _proof_failed(self, error: ExportError) -> None:
        with contextlib.suppress(LedgerError):  # the report stands without this event too
            self.ctx.ledger.event(
                "destroy_proof_failed",
                run_id=self.run_id,
                episode_id=self.episode_id,
                env_id=self.env_id,
                error=str(error),
            )
        self.ctx.emit("alert", message=str(error), env_id=self.env_id, episode_id=self.episode_id)


async def release_spares(ctx: RunContext, run_id: str) -> list[str]:
    """Destroy the envs the driver started ahead that no episode took, record each
    (``spare_destroyed``, or ``env_leaked`` and an alert); the ids of those that remain."""
    leaked = []
    for report in await ctx.driver.release_spares():
        kind = "spare_destroyed" if report.confirmed_absent else "env_leaked"
        ctx.ledger.event(kind, run_id=run_id, env_id=report.env_id, cleanup_ms=report.elapsed_ms)
        if not report.confirmed_absent:
            leaked.append(report.env_id)
            ctx.emit(
                "alert", message=f"spare env {report.env_id} still present", env_id=report.env_id
            )
    return leaked


def _destroy_json(report: DestroyReport) -> bytes:
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

"""The end of an episode: collect, verify, export, destroy + confirm absent, and the ledger.

``finish_episode`` runs shielded from cancellation (see ``shielded.until_done``): whatever
happened before, the evidence is exported (the record last) or the attempt kept, the env is
destroyed and confirmed absent, and the episode ends with exactly one ``Outcome``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cleanroom.agent.session import EpisodeOutput
from cleanroom.baseline.model import Baseline
from cleanroom.batch.result import EpisodeResult
from cleanroom.drivers.base import Env
from cleanroom.errors import StoreError
from cleanroom.export import export_attempt, export_episode
from cleanroom.lifecycle.clock import EpisodeClock
from cleanroom.lifecycle.lease import destroy_env
from cleanroom.manifest import Manifest
from cleanroom.network.egress import Egress
from cleanroom.record import Outcome
from cleanroom.secrets import Redactor
from cleanroom.verify import verdict_label

if TYPE_CHECKING:
    from cleanroom.batch.runner import Controller


async def finish_episode(
    ctl: Controller,
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
    crash: str | None = None,
) -> None:
    """Export the evidence, destroy the env, write the ledger. Runs shielded.

    ``crash``: the traceback of an unexpected exception, kept as ``logs/traceback.txt`` of the
    attempt. An unexpected exception here ends the episode ``infra_error`` the same way; the env
    is destroyed whatever happened."""
    eid = manifest.episode_id
    if redactor and error:
        error = redactor.redact_text(error)  # errors reach the ledger and the terminal
    diagnostics: dict[str, bytes] = {}
    if crash is not None:
        diagnostics["traceback.txt"] = crash.encode("utf-8", "backslashreplace")
    try:
        ctl.ledger.episode_state(run_id, eid, attempt, "COLLECTING", env_id=env_id)
        diagnostics.update(env.diagnostics() if env is not None else {})
        facts = {
            **ctl.driver.describe(),
            **(_env_facts(env) if env else {}),
            **_entry_facts(baseline, output),
        }
        if egress is not None:  # the episode is over: cut its network, keep its log
            diagnostics.update(await egress.finish())
            facts["network"] = egress.summary()
        try:
            if outcome.final and output is not None:
                if manifest.verifier is not None:
                    ctl.ledger.episode_state(run_id, eid, attempt, "VERIFYING", env_id=env_id)
                verdict = await ctl.verifiers.verify(
                    store=ctl.store,
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
                    ctl.store,
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
                ctl.ledger.episode_state(run_id, eid, attempt, "DURABLE", env_id=env_id)
            else:
                await asyncio.to_thread(
                    export_attempt,
                    ctl.store,
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
            ctl.ledger.event("export_failed", run_id=run_id, episode_id=eid, error=str(exc))
    except Exception as exc:  # a bug, or guest input no boundary caught: this episode only
        if episode.record is not None:  # durable already: the record's outcome stands
            ctl._emit("alert", message=f"after the record of {eid}: {type(exc).__name__}: {exc}")
            return
        outcome, error = Outcome.INFRA_ERROR, f"unexpected {type(exc).__name__}: {exc}"
        if redactor:
            error = redactor.redact_text(error)
        diagnostics["traceback.txt"] = traceback.format_exc().encode("utf-8", "backslashreplace")
        with contextlib.suppress(Exception):  # best effort: the traceback for the attempt
            await asyncio.to_thread(
                export_attempt,
                ctl.store,
                run_id,
                manifest,
                attempt,
                env_id,
                outcome,
                error,
                None,
                diagnostics,
                redactor,
            )
    finally:
        with contextlib.suppress(Exception):  # the ledger's state must not stop the destroy
            ctl.ledger.episode_state(run_id, eid, attempt, "DESTROYING", env_id=env_id)
        episode.destroy = await destroy_env(ctl, env, env_id, run_id, eid, attempt)
        if egress is not None:
            await egress.aclose()
        await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
        episode.outcome, episode.error = outcome, error
        ctl.ledger.episode_finished(
            run_id,
            eid,
            attempt,
            outcome=outcome.value,
            reward=episode.reward,
            error=error,
            verdict=verdict_label((episode.record or {}).get("verdict")),
        )
        ctl._emit(
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

"""Verifiers: a deterministic check that turns an episode's evidence into a verdict.

A manifest names its verifier (``Manifest.verifier``: baseline, command, ``in_env``). After an
episode reaches a final outcome, and before its record is written, the controller asks
``Verifiers.verify`` for a verdict. The verifier's command sees, under ``$CLEANROOM_DIR/input/``:

    manifest.json     the episode's manifest (as the episode saw it)
    episode.json      episode_id, seed, outcome, error, exit status, artifacts (name, size, sha256)
    result.json       the episode's own result.json, if it wrote one
    artifacts/<name>  every exported artifact, byte for byte

and writes ``$CLEANROOM_DIR/verdict.json``: ``{"pass": bool, "score": number, "details": {...}}``.
By default it runs in a fresh env of its own, created from the verifier's baseline with only that
input (the episode cannot tamper with its check); ``in_env: true`` runs it in the episode's env
before teardown. The verdict lands in the durable record (``record["verdict"]``), apart from the
outcome: a verifier that crashes, times out or writes no valid verdict gives
``{"error": ..., "classification": "verifier_error"}`` and leaves the outcome as it was. The
verifier's stdout and stderr are kept in the store under the attempt's ``attempts/<n>/verifier/``
(``verdict.verifier.logs`` names them).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from cleanroom.agent import wire
from cleanroom.agent.connection import EpisodeOutput, ExecResult
from cleanroom.baseline import store as baseline_store
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Driver, Env, EnvRequest, new_env_id
from cleanroom.errors import CleanroomError, ProtocolError, VerifierError
from cleanroom.evidence.export import redact_output
from cleanroom.evidence.manifest import Manifest, VerifierRef
from cleanroom.evidence.secrets import Redactor
from cleanroom.lifecycle.context import RunContext
from cleanroom.lifecycle.lease import EnvLease
from cleanroom.store import Store
from cleanroom.store.layout import attempt_dir

VERIFIER_ERROR = "verifier_error"
VERDICT_MAX = 1024 * 1024
PUT_CHUNK = 512 * 1024  # below the agent's frame limit; larger files go in parts


def guest_prefix(driver: Driver, env_id: str) -> str:
    """Where an env's ``/`` lies on the host for drivers without a VM (fake); else ``""``."""
    method = getattr(driver, "guest_prefix", None)
    return str(method(env_id)) if callable(method) else ""


def parse_verdict(raw: bytes) -> dict[str, Any]:
    """Validate a verdict.json; VerifierError says what is wrong with it."""
    if len(raw) > VERDICT_MAX:
        raise VerifierError(f"verdict.json is larger than {VERDICT_MAX} bytes")
    try:  # a verifier runs in a guest: its bytes cross the same boundary as an episode's
        data = wire.decode_json(raw, wire.JsonLimits(VERDICT_MAX), "verdict.json")
    except ProtocolError as exc:
        raise VerifierError(str(exc)) from exc
    if not isinstance(data, dict) or not isinstance(data.get("pass"), bool):
        raise VerifierError("verdict.json must be an object with a boolean 'pass'")
    score = data.get("score", 1.0 if data["pass"] else 0.0)
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise VerifierError("verdict.json: 'score' must be a finite number")
    details = data.get("details", {})
    return {
        "pass": data["pass"],
        "score": float(score),
        "details": details if isinstance(details, dict) else {"value": details},
    }


def verdict_label(verdict: dict[str, Any] | None) -> str | None:
    """``pass`` / ``fail`` / ``verifier_error`` for the ledger (None: no verifier)."""
    if verdict is None:
        return None
    if "error" in verdict:
        return VERIFIER_ERROR
    return "pass" if verdict.get("pass") else "fail"


def verifier_input(
    manifest: Manifest, outcome: Outcome, error: str | None, output: EpisodeOutput
) -> dict[str, bytes]:
    """The files a verifier gets, by name relative to its input folder."""
    exit_ = output.exit
    episode = {
        "episode_id": manifest.episode_id,
        "seed": manifest.seed,
        "outcome": outcome.value,
        "error": error,
        "exit": {"code": exit_.exit_code, "signal": exit_.signal, "timed_out": exit_.timed_out},
        "artifacts": [
            {"name": a.name, "size": a.size, "sha256": a.sha256} for a in output.artifacts
        ],
    }
    files = {
        "manifest.json": json.dumps(manifest.guest_view(), sort_keys=True).encode(),
        "episode.json": json.dumps(episode, sort_keys=True).encode(),
    }
    if output.result_raw is not None:
        files["result.json"] = output.result_raw
    for artifact in output.artifacts:
        files[f"artifacts/{artifact.name}"] = artifact.path.read_bytes()
    return files


async def put_files(env: Env, base: str, files: dict[str, bytes]) -> None:
    """PUT files under ``base`` in the guest; a file above the frame limit goes in parts."""
    for name, data in sorted(files.items()):
        path = f"{base}/{name}"
        if len(data) <= PUT_CHUNK:
            await env.put(path, data)
            continue
        parts = range(0, len(data), PUT_CHUNK)
        for index, offset in enumerate(parts):
            await env.put(f"{path}.part{index:06d}", data[offset : offset + PUT_CHUNK])
        joined = await env.exec(["sh", "-c", 'cat "$0".part* > "$0" && rm -f "$0".part*', path])
        if not joined.ok:
            raise VerifierError(f"cannot assemble {name} in the verifier's env")


async def run_command(
    env: Env, prefix: str, ref: VerifierRef, files: dict[str, bytes]
) -> tuple[dict[str, Any], ExecResult]:
    """Put the input, run the command, read and validate the verdict."""
    root = f"{prefix}/run/cleanroom"
    await put_files(env, f"{root}/input", files)
    result = await env.exec(
        list(ref.command),
        timeout_s=ref.timeout_s,
        env={"CLEANROOM_DIR": root, "CLEANROOM_VERIFIER_INPUT": f"{root}/input"},
    )
    if result.timed_out:
        raise VerifierError(f"the verifier timed out after {ref.timeout_s:g}s")
    try:
        raw = await env.get(f"{root}/verdict.json")
    except CleanroomError as exc:
        tail = result.stderr[-300:].decode(errors="replace").strip()
        raise VerifierError(
            f"the verifier wrote no verdict.json (exit {result.exit_code}): {tail or exc}"
        ) from exc
    return parse_verdict(raw), result


class Verifiers:
    """Runs manifests' verifiers for one run (its env leases: ``RunContext``)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._baselines: dict[str, Baseline] = {}

    def prepare(self, manifests: list[Manifest]) -> None:
        """Resolve (or build) and re-hash every verifier baseline; raises before any episode."""
        for ref in sorted(
            {m.verifier.baseline for m in manifests if m.verifier and m.verifier.baseline}
        ):
            if ref not in self._baselines:
                baseline = resolve_or_build(ref)
                baseline_store.require_intact(baseline, reuse=True)
                self._baselines[ref] = baseline

    def _baseline(self, ref: VerifierRef, episode_baseline: Baseline) -> Baseline:
        if ref.baseline is None:
            return episode_baseline
        if ref.baseline not in self._baselines:
            self._baselines[ref.baseline] = baseline_store.resolve(ref.baseline)
        return self._baselines[ref.baseline]

    async def verify(
        self,
        *,
        store: Store,
        run_id: str,
        manifest: Manifest,
        attempt: int,
        baseline: Baseline,
        env: Env | None,
        outcome: Outcome,
        error: str | None,
        output: EpisodeOutput,
        redactor: Redactor | None = None,
    ) -> dict[str, Any] | None:
        """The verdict of one episode (None without a verifier). Never raises CleanroomError
        except a StoreError keeping the verifier's logs."""
        ref = manifest.verifier
        if ref is None:
            return None
        redact_output(output, {}, redactor)  # a verifier sees no secret either
        about: dict[str, Any] = {"command": list(ref.command), "in_env": ref.in_env}
        result: ExecResult | None = None
        try:
            files = verifier_input(manifest, outcome, error, output)
            vbaseline = self._baseline(ref, baseline)
            about["baseline"] = vbaseline.digest
            if ref.in_env:
                if env is None or not env.alive():
                    raise VerifierError("the episode's env is gone; cannot verify in it")
                about["env_id"] = env.env_id
                prefix = guest_prefix(self.ctx.driver, env.env_id)
                verdict, result = await run_command(env, prefix, ref, files)
            else:
                verdict, result = await self._in_fresh_env(
                    run_id, manifest, attempt, vbaseline, ref, files, about
                )
        except (CleanroomError, OSError) as exc:
            verdict = {"error": f"{type(exc).__name__}: {exc}", "classification": VERIFIER_ERROR}
        if result is not None:
            about["exit_code"] = result.exit_code
            logs = [f"{attempt_dir(attempt)}/verifier/{n}" for n in ("stdout.log", "stderr.log")]
            store.put_bytes(run_id, manifest.episode_id, logs[0], result.stdout)
            store.put_bytes(run_id, manifest.episode_id, logs[1], result.stderr)
            about["logs"] = logs
        verdict["verifier"] = about
        self.ctx.ledger.event(
            "verified",
            run_id=run_id,
            episode_id=manifest.episode_id,
            verdict=verdict_label(verdict),
            score=verdict.get("score"),
            error=verdict.get("error"),
        )
        return verdict

    async def _in_fresh_env(
        self,
        run_id: str,
        manifest: Manifest,
        attempt: int,
        baseline: Baseline,
        ref: VerifierRef,
        files: dict[str, bytes],
        about: dict[str, Any],
    ) -> tuple[dict[str, Any], ExecResult]:
        ctx = self.ctx
        env_id = new_env_id()
        about["env_id"] = env_id
        eid = manifest.episode_id
        lease = EnvLease(
            ctx,
            env_id,
            run_id=run_id,
            episode_id=eid,
            attempt=attempt,
            proof=f"attempts/{attempt}/verifier-destroy.json",
        )
        async with lease:  # destroyed and confirmed absent on every path
            baseline_store.quick_check(baseline)
            limits = manifest.limits.merged_over(baseline.limits)
            o = ctx.options
            deadline = o.boot_timeout_s + ref.timeout_s + o.cleanup_window_s + 30
            request = EnvRequest(
                env_id,
                baseline,
                limits,
                ctx.owner,
                deadline,
                labels={"run_id": run_id, "episode_id": eid, "role": "verifier"},
            )
            env = await lease.start(request)
            prefix = guest_prefix(ctx.driver, env_id)
            try:
                return await asyncio.wait_for(
                    run_command(env, prefix, ref, files), ref.timeout_s + 60
                )
            except TimeoutError as exc:
                msg = f"the verifier did not finish within {ref.timeout_s:g}s"
                raise VerifierError(msg) from exc

"""An episode's RUN in its env: the request the agent gets, and the ``Outcome`` of its answer.

What the guest causes is the guest's outcome, final and durable: a guest that breaks the
protocol or its quota, or writes a result that cannot be recorded, ends ``episode_error`` with
the evidence already staged (its logs, the artifacts that arrived) kept for the record.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

from cleanroom.agent.connection import Artifact, EpisodeOutput, ExecResult
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.core.states import Outcome, classify
from cleanroom.drivers.base import Env
from cleanroom.errors import EnvCrashed, ProtocolError
from cleanroom.evidence import header_budget
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.record import parse_guest_result
from cleanroom.host.digests import sha256_file


async def run_in_env(
    env: Env,
    manifest: Manifest,
    baseline: Baseline,
    limits: ResolvedLimits,
    staging: Path,
    secret_values: dict[str, str],
    *,
    collect_grace_s: float,
) -> tuple[Outcome, str | None, EpisodeOutput | None]:
    """RUN the episode, collect its output into ``staging``; classify how it ended."""
    request = episode_request(manifest, baseline, limits, secret_values)
    quota = limits.output_quota_mib * 1024 * 1024
    try:
        output = await asyncio.wait_for(
            env.run_episode(request, staging, quota_bytes=quota),
            limits.timeout_s + collect_grace_s,
        )
    except TimeoutError:
        return Outcome.TIMEOUT, f"no answer from the guest within {limits.timeout_s}s", None
    except (EnvCrashed, ProtocolError, OSError) as exc:
        failure = classify(exc, in_guest=True)
        if failure.outcome is Outcome.INFRA_ERROR:
            raise  # the host's failure, not the guest's
        if not failure.outcome.final:
            return failure.outcome, failure.error, None
        kept = await asyncio.to_thread(staged_output, staging)
        error = failure.error
        if kept.artifacts:  # the guest stopped mid-stream: one of them may be cut short
            error += f" (kept the {len(kept.artifacts)} artifact file(s) as far as they arrived)"
        return failure.outcome, error, kept
    if output.exit.timed_out:
        return Outcome.TIMEOUT, f"entrypoint exceeded its {limits.timeout_s}s deadline", output
    if output.exit.exit_code != 0:
        how = (
            f"exit code {output.exit.exit_code}"
            if output.exit.signal is None
            else f"signal {output.exit.signal}"
        )
        return Outcome.EPISODE_ERROR, f"entrypoint failed ({how})", output
    problem = result_problem(output)
    if problem is not None:
        return Outcome.EPISODE_ERROR, problem, output
    return Outcome.COMPLETED, None, output


def episode_request(
    manifest: Manifest,
    baseline: Baseline,
    limits: ResolvedLimits,
    secret_values: dict[str, str],
) -> dict[str, Any]:
    """The RUN request the agent gets: one frame header (``header_budget`` bounds its size)."""
    lifetimes = {s.name: s.lifetime_s for s in manifest.secrets if s.lifetime_s}
    return {
        "manifest": manifest.guest_view(),
        **_entry(baseline),
        "timeout_s": limits.timeout_s,
        "env": {
            **baseline.image_env,
            "CLEANROOM_EPISODE_ID": manifest.episode_id,
            "CLEANROOM_SEED": str(manifest.seed),
            **secret_values,
        },
        "secret_files": secret_values,
        "secret_lifetimes": lifetimes,
    }


def request_problems(
    manifests: list[Manifest], baseline: Baseline, secret_values: dict[str, str]
) -> list[str]:
    """Why each manifest's RUN request could not reach the guest (``header_budget``), by
    episode; ``BuildError`` if the baseline's own entry is too large for any of them."""
    header_budget.check_entry(
        f"baseline {baseline.digest[:19]}", _entry(baseline), baseline.image_env
    )
    problems = []
    for manifest in manifests:
        limits = manifest.limits.merged_over(baseline.limits)
        mine = {s.name: secret_values[s.name] for s in manifest.secrets if s.name in secret_values}
        found = header_budget.request_problem(episode_request(manifest, baseline, limits, mine))
        if found is not None:
            problems.append(f"episode {manifest.episode_id!r}: {found}")
    return problems


def result_problem(output: EpisodeOutput) -> str | None:
    """Why the guest's result.json cannot be used, or None. One the record cannot hold (a
    number JSON has no form for, such as ``1e999``) is dropped: the record says why."""
    guest = parse_guest_result(output.result_raw)
    if guest.problem is not None:
        return guest.problem
    try:
        json.dumps([guest.info, guest.metrics], allow_nan=False)
    except (TypeError, ValueError) as exc:
        output.result_raw = None
        return f"result.json: 'info' or 'metrics' cannot be recorded as strict JSON: {exc}"
    return None


def staged_output(staging: Path) -> EpisodeOutput:
    """What a RUN cut short left in ``staging``: its logs and the artifact files there (regular
    files only; links are neither followed nor kept). The exit status is unknown."""
    output = EpisodeOutput(exit=ExecResult(None, None, b"", b"", 0.0, False))
    logs = staging / "logs"
    output.stdout_path = _regular(logs / "stdout.log")
    output.stderr_path = _regular(logs / "stderr.log")
    root = staging / "artifacts"
    for folder, dirs, files in os.walk(root):  # never follows links
        dirs.sort()
        for name in sorted(files):
            path = _regular(Path(folder) / name)
            if path is not None:
                rel = path.relative_to(root).as_posix()
                output.artifacts.append(Artifact(rel, path.stat().st_size, sha256_file(path), path))
    return output


def _regular(path: Path) -> Path | None:
    try:
        return path if stat.S_ISREG(path.lstat().st_mode) else None
    except OSError:
        return None


def _entry(baseline: Baseline) -> dict[str, Any]:
    """What RUN says to run: the function (the agent's warm worker calls it) or the command
    (as the image's ``User``, if it names one)."""
    where = {"cwd": baseline.workdir} if baseline.workdir else {}
    if baseline.function is not None:
        return {"function": baseline.function.to_json(), **where}
    return {"entrypoint": baseline.as_user(list(baseline.entrypoint)), **where}

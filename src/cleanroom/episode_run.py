"""An episode's RUN in its env: the request the agent gets, and the ``Outcome`` of its answer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cleanroom.agent.session import EpisodeOutput
from cleanroom.baseline.model import Baseline
from cleanroom.drivers.base import Env
from cleanroom.errors import EnvCrashed, ProtocolError
from cleanroom.manifest import Manifest, ResolvedLimits
from cleanroom.record import Outcome, parse_guest_result


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
    lifetimes = {s.name: s.lifetime_s for s in manifest.secrets if s.lifetime_s}
    request = {
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
    quota = limits.output_quota_mib * 1024 * 1024
    try:
        output = await asyncio.wait_for(
            env.run_episode(request, staging, quota_bytes=quota),
            limits.timeout_s + collect_grace_s,
        )
    except TimeoutError:
        return Outcome.TIMEOUT, f"no answer from the guest within {limits.timeout_s}s", None
    except EnvCrashed as exc:
        return Outcome.ENV_CRASHED, str(exc), None
    except ProtocolError as exc:
        return Outcome.EPISODE_ERROR, f"{type(exc).__name__}: {exc}", None
    if output.exit.timed_out:
        return Outcome.TIMEOUT, f"entrypoint exceeded its {limits.timeout_s}s deadline", output
    if output.exit.exit_code != 0:
        how = (
            f"exit code {output.exit.exit_code}"
            if output.exit.signal is None
            else f"signal {output.exit.signal}"
        )
        return Outcome.EPISODE_ERROR, f"entrypoint failed ({how})", output
    problem = parse_guest_result(output.result_raw).problem
    if problem is not None:
        return Outcome.EPISODE_ERROR, problem, output
    return Outcome.COMPLETED, None, output


def _entry(baseline: Baseline) -> dict[str, Any]:
    """What RUN says to run: the function (the agent's warm worker calls it) or the command."""
    where = {"cwd": baseline.workdir} if baseline.workdir else {}
    if baseline.function is not None:
        return {"function": baseline.function.to_json(), **where}
    return {"entrypoint": list(baseline.entrypoint), **where}

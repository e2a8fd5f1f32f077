"""The Python API: run a batch of manifests (async, with a thin sync wrapper).

import cleanroom
result = cleanroom.run("examples/cartpole/manifests.jsonl",
                       baseline="examples/cartpole/baseline.toml", parallel=2)
print(result.counts())

Episodes that share a setup step (one task, N rollouts) form a group: ``group(...)`` stamps
one onto manifests; the setup then runs once in a warm env that every episode is forked from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cleanroom.baseline.model import Baseline
from cleanroom.baseline.store import resolve_or_build
from cleanroom.controller import Controller, EventHook, RunOptions, RunResult
from cleanroom.drivers import get_driver
from cleanroom.errors import ManifestError
from cleanroom.ledger import Ledger
from cleanroom.manifest import Group, GroupSetup, Manifest, check_groups, load_manifests
from cleanroom.secrets import provider_from
from cleanroom.store import open_store

if TYPE_CHECKING:
    from cleanroom.integrations.ray import RayCluster


async def arun(
    manifests: list[Manifest] | str | Path,
    *,
    baseline: Baseline | str | Path,
    parallel: int = 2,
    store: str | Path | None = None,
    run_id: str | None = None,
    driver: str = "qemu",
    options: RunOptions | None = None,
    on_event: EventHook | None = None,
    secrets_from: str | None = None,
    cluster: RayCluster | None = None,
) -> RunResult:
    """Run manifests (a list, or a JSON Lines file) on fresh environments of ``baseline``.

    ``secrets_from`` picks the secret provider (see ``cleanroom.secrets.provider_from``).
    ``cluster``: run across the nodes of a Ray cluster (``cleanroom[ray]``) instead of here.
    """
    if not isinstance(manifests, list):
        manifests = load_manifests(Path(manifests))
    resolved = baseline if isinstance(baseline, Baseline) else resolve_or_build(str(baseline))
    opts = options or RunOptions(parallel=parallel)
    if cluster is not None:
        from cleanroom.integrations.ray.scheduler import run_on_cluster

        source = None if isinstance(baseline, Baseline) else str(baseline)
        return await run_on_cluster(
            cluster,
            manifests,
            resolved,
            source=source,
            store=store,
            run_id=run_id,
            driver=driver,
            options=opts,
            on_event=on_event,
        )
    with Ledger() as ledger:
        controller = Controller(
            get_driver(driver),
            ledger,
            open_store(store),
            options=opts,
            on_event=on_event,
            secret_provider=provider_from(secrets_from),
        )
        return await controller.run(manifests, resolved, run_id=run_id)


def run(
    manifests: list[Manifest] | str | Path,
    *,
    baseline: Baseline | str | Path,
    parallel: int = 2,
    store: str | Path | None = None,
    run_id: str | None = None,
    driver: str = "qemu",
    cluster: RayCluster | None = None,
) -> RunResult:
    """Blocking ``arun``."""
    return asyncio.run(
        arun(
            manifests,
            baseline=baseline,
            parallel=parallel,
            store=store,
            run_id=run_id,
            driver=driver,
            cluster=cluster,
        )
    )


def group(
    group_id: str,
    setup: list[str] | GroupSetup | dict[str, Any],
    episodes: Iterable[Manifest | dict[str, Any]],
) -> list[Manifest]:
    """``episodes`` as one group sharing ``setup`` (a command, or ``GroupSetup`` fields).

    manifests = cr.group("task-7", ["sh", "-c", "cp -r /opt/repo /work && make -C /work deps"],
                         [{"episode_id": f"task-7-{i}", "seed": i, "policy": {"id": "p"}}
                          for i in range(8)])
    """
    try:
        if isinstance(setup, list):
            setup = GroupSetup(command=setup)
        elif isinstance(setup, dict):
            setup = GroupSetup.model_validate(setup)
        stamp = Group(id=group_id, setup=setup)
        out = []
        for episode in episodes:
            data = episode.model_dump() if isinstance(episode, Manifest) else dict(episode)
            out.append(Manifest.model_validate({**data, "group": stamp}))
    except ValidationError as exc:
        raise ManifestError(f"group {group_id!r}: invalid", [str(exc)]) from exc
    check_groups(out)
    return out

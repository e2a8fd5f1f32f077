"""The Python API: run a batch of manifests (async, with a thin sync wrapper).

import cleanroom
result = cleanroom.run("examples/cartpole/manifests.jsonl",
                       baseline="examples/cartpole/baseline.toml", parallel=2)
print(result.counts())
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from cleanroom.baseline.model import Baseline
from cleanroom.baseline.store import resolve_or_build
from cleanroom.controller import Controller, EventHook, RunOptions, RunResult
from cleanroom.drivers import get_driver
from cleanroom.ledger import Ledger
from cleanroom.manifest import Manifest, load_manifests
from cleanroom.secrets import provider_from
from cleanroom.store import open_store


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
) -> RunResult:
    """Run manifests (a list, or a JSON Lines file) on fresh environments of ``baseline``.

    ``secrets_from`` picks the secret provider (see ``cleanroom.secrets.provider_from``).
    """
    if not isinstance(manifests, list):
        manifests = load_manifests(Path(manifests))
    resolved = baseline if isinstance(baseline, Baseline) else resolve_or_build(str(baseline))
    opts = options or RunOptions(parallel=parallel)
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
        )
    )

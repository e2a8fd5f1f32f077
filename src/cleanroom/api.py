"""The Python API: run a batch of manifests (async, with a sync wrapper of the same signature).

import cleanroom
result = cleanroom.run("examples/cartpole/manifests.jsonl",
                       baseline="examples/cartpole/baseline.toml", parallel=2)
print(result.counts(), result.rewards())

Manifests are a JSON Lines file or a list of ``Manifest`` objects and plain dicts (validated like
a file's lines: ``item 3: seed: ...``). ``RunResult.episodes`` keeps the input order.

Episodes that share a setup step (one task, N rollouts) form a group: ``group(...)`` stamps
one onto manifests; the setup then runs once in a warm env that every episode is forked from.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from pydantic import ValidationError

from cleanroom.baseline.resolve import resolve_baseline
from cleanroom.batch.result import RunResult
from cleanroom.batch.runner import Controller, EventHook, RunOptions
from cleanroom.core import events
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import Limits
from cleanroom.drivers import get_driver
from cleanroom.drivers.base import Env, EnvRequest, Owner, new_env_id
from cleanroom.errors import ManifestError
from cleanroom.evidence.manifest import (
    Group,
    GroupSetup,
    Manifest,
    check_groups,
    coerce_manifests,
    describe,
    load_manifests,
)
from cleanroom.evidence.secrets import provider_from
from cleanroom.host import private
from cleanroom.ledger import Ledger
from cleanroom.store import open_store

Manifests = Iterable[Manifest | dict[str, Any]] | str | Path
"""A JSON Lines file, or manifests as ``Manifest`` objects and/or plain dicts."""
_P = ParamSpec("_P")
_T = TypeVar("_T")


def manifests_of(manifests: Manifests) -> list[Manifest]:
    """``manifests`` validated (a file's lines, or a list's items) into ``Manifest`` objects."""
    if isinstance(manifests, str | Path):
        return load_manifests(Path(manifests))
    return coerce_manifests(manifests)


if TYPE_CHECKING:
    from cleanroom.integrations.ray import RayCluster


async def arun(
    manifests: Manifests,
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
    """Run manifests (a JSON Lines file, or a list of ``Manifest``s and dicts) on fresh
    environments of ``baseline``; the result lists its episodes in the input order.

    ``options`` wins over ``parallel``; ``on_event(kind, data)`` sees every run event;
    ``secrets_from`` picks the secret provider (see ``cleanroom.evidence.secrets.provider_from``).
    ``cluster``: run across the nodes of a Ray cluster (``cleanroom[ray]``) instead of here;
    each node resolves the secrets with ``secrets_from`` on its own host (no value travels).
    """
    private.check_home()  # the home is private (0700, ours), umask 077; else PrivacyError
    items = manifests_of(manifests)
    provider = provider_from(secrets_from)  # a malformed spec is refused before anything runs
    resolved = resolve_baseline(baseline)
    opts = options or RunOptions(parallel=parallel)
    if cluster is not None:
        from cleanroom.integrations.ray.scheduler import run_on_cluster

        source = None if isinstance(baseline, Baseline) else str(baseline)
        return await run_on_cluster(
            cluster,
            items,
            resolved,
            source=source,
            store=store,
            run_id=run_id,
            driver=driver,
            options=opts,
            on_event=on_event,
            secrets_from=secrets_from,
        )
    st = open_store(store)
    with Ledger() as ledger:
        hook = _RunEvents(ledger, run_id, on_event)
        controller = Controller(
            get_driver(driver),
            ledger,
            st,
            options=opts,
            on_event=hook,
            secret_provider=provider,
        )
        with events.hooked(hook):  # a driver building a template reports through it
            result = await controller.run(items, resolved, run_id=run_id)
    return result.ordered([m.episode_id for m in items], st)


class _RunEvents:
    """The run's event hook: every event to ``on_event``; those of parts below the controller
    (``template_*``, see ``cleanroom.core.events``) also to the ledger, so the report can mark the
    envs that waited for a template build."""

    def __init__(self, ledger: Ledger, run_id: str | None, on_event: EventHook | None) -> None:
        self.ledger, self.run_id, self.on_event = ledger, run_id, on_event

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "run_started":
            self.run_id = data["run_id"]
        if kind.startswith("template_"):
            self.ledger.event(kind, run_id=self.run_id, **data)
        if self.on_event is not None:
            self.on_event(kind, data)


def blocking(fn: Callable[_P, Coroutine[Any, Any, _T]], name: str) -> Callable[_P, _T]:
    """``fn``'s blocking twin, called ``name``: the same arguments (``inspect.signature`` and
    ``help`` show ``fn``'s), run to the end in an event loop of its own."""

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return asyncio.run(fn(*args, **kwargs))

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Blocking ``{fn.__name__}`` (the same arguments)."
    return call


run = blocking(arun, "run")


@asynccontextmanager
async def open_env(
    baseline: Baseline | str | Path,
    *,
    driver: str = "qemu",
    limits: Limits | dict[str, Any] | None = None,
    hard_deadline_s: float = 600.0,
) -> AsyncIterator[Env]:
    """One fresh environment of ``baseline`` that you drive yourself (``exec``, ``put``,
    ``get``), destroyed when the block ends. No run, no ledger rows, no record: for
    exploring a baseline, not for episodes.

    async with cleanroom.open_env("examples/cartpole") as env:
        print((await env.exec(["uname", "-r"])).check().stdout.decode())
    """
    resolved = resolve_baseline(baseline)
    try:
        wanted = limits if isinstance(limits, Limits) else Limits.model_validate(limits or {})
    except ValidationError as exc:
        raise ManifestError("open_env: invalid limits", describe(exc)) from exc
    request = EnvRequest(
        new_env_id(),
        resolved,
        wanted.merged_over(resolved.limits),
        Owner("open_env"),
        hard_deadline_s=hard_deadline_s,
    )
    async with await get_driver(driver).create(request) as env:
        yield env


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
    except ValidationError as exc:
        raise ManifestError(f"group {group_id!r}: invalid", describe(exc)) from exc
    stamped = [
        {**(e.model_dump() if isinstance(e, Manifest) else e), "group": stamp}
        if isinstance(e, Manifest | dict)
        else e
        for e in episodes
    ]
    out = coerce_manifests(stamped, source=f"group {group_id!r}")
    check_groups(out)
    return out

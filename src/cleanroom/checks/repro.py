"""``cleanroom check repro``: the same manifest, N fresh envs, the same result record?

Runs the manifests ``repeat`` times, each time as a run of its own (so every episode gets a fresh
env and a record of its own), then compares each episode's records field by field, leaving out
what is expected to change between runs (``IGNORED``): identities (run_id, attempt, env ids),
everything that says how long something took (timings, logs, every ``provenance.*_s``), and
everything that says how and where the env was started (spare, snapshot, fork or cold; the
host). Anything else that differs is reported with its value in each run. Users add their own
volatile fields with ``--ignore`` and narrow the comparison with ``--only``.
"""

from __future__ import annotations

import asyncio
import fnmatch
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from cleanroom.batch.result import RunResult
from cleanroom.batch.runner import Controller
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import CheckError
from cleanroom.evidence.manifest import Manifest
from cleanroom.store import Store

IDENTITY = (
    "run_id",
    "attempt",
    "provenance.env_id",
    "provenance.jail.cgroup",  # the env's own cgroup: its path names the env
    "provenance.jail.limit_cgroups",  # so do its limit cgroups
    "provenance.jail.chroot",  # its empty root, inside its run folder
    "provenance.jail.uid",  # a jail uid of its own, whichever was free
    "provenance.jail.gid",
    "provenance.jail.user",
    "verdict.verifier.env_id",
    "evidence",  # the attempt's folder, attempts/<n>: it names the attempt
    "artifacts.*.path",
    "verdict.verifier.logs",
)
"""Names this run gave: a new run, attempt and env every time."""
DURATIONS = (
    "timings",
    "logs",  # they carry timings and boot messages
    "exit.duration_s",
    "provenance.*_s",  # guest_boot_s, spare_s, group.setup_s, ...
    "provenance.*_ms",
)
"""How long something took."""
STARTS = (
    "provenance.host",
    "provenance.start",
    "provenance.start_note",
    "provenance.template",
    "provenance.worker",  # a spare's or template's worker is warm, a cold boot's is started
    "provenance.console_bytes",  # a cold boot prints its kernel's messages, a clone does not
    "provenance.group.snapshot",  # a group's warm state is made anew each run (its RAM differs)
    "provenance.group.snapshot_id",
    "provenance.group.digest",
    "provenance.group.parent_env",
)
"""How (and where) an env was started: spare, snapshot, fork or cold, on which host."""
IGNORED = IDENTITY + DURATIONS + STARTS
"""Left out of every comparison; ``--ignore`` adds to it, ``--only`` narrows what is left.
A pattern is an fnmatch glob over dotted paths (``*`` crosses dots) and also covers everything
below the path it names (``logs`` covers ``logs.stdout.sha256``)."""
ABSENT = "<absent>"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A JSON value as {dotted path: leaf}; list items are numbered (``artifacts.0.sha256``)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for index, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{index}" if prefix else str(index)))
        return out
    return {prefix: value}


@dataclass(frozen=True)
class Fields:
    """Which leaves of a record are compared: not ``ignored``, and (when given) in ``only``."""

    ignored: tuple[str, ...] = IGNORED
    only: tuple[str, ...] = ()

    def compared(self, path: str) -> bool:
        if any(_covers(pattern, path) for pattern in self.ignored):
            return False
        return not self.only or any(_covers(pattern, path) for pattern in self.only)


def _covers(pattern: str, path: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + ".*")


def fields(ignore: list[str] | None = None, only: list[str] | None = None) -> Fields:
    """The default ignored set plus ``ignore``, narrowed to ``only``; blank patterns are refused."""
    for pattern in [*(ignore or ()), *(only or ())]:
        if not pattern.strip():
            raise CheckError("--ignore/--only: a field pattern must not be empty")
    return Fields(IGNORED + tuple(ignore or ()), tuple(only or ()))


def comparable(record: dict[str, Any], which: Fields = Fields()) -> dict[str, Any]:
    """The record's leaves that ``which`` compares."""
    return {path: value for path, value in flatten(record).items() if which.compared(path)}


def differences(records: list[dict[str, Any]], which: Fields = Fields()) -> dict[str, list[Any]]:
    """Paths whose values are not the same in every record, with each record's value."""
    flat = [comparable(r, which) for r in records]
    out: dict[str, list[Any]] = {}
    for path in sorted(set().union(*flat)) if flat else []:
        values = [f.get(path, ABSENT) for f in flat]
        if len({repr(v) for v in values}) > 1:
            out[path] = values
    return out


@dataclass
class EpisodeRepro:
    episode_id: str
    outcomes: list[str]
    compared: int  # fields compared
    differing: dict[str, list[Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # runs without a durable record
    errors: list[str | None] = field(default_factory=list)  # each run's error, if any

    @property
    def identical(self) -> bool:
        """Every run has a record, at least one field was compared (an ``--only`` that matches
        nothing proves nothing), and no compared field differs."""
        return not self.differing and not self.missing and self.compared > 0


@dataclass
class ReproReport:
    baseline: str
    repeat: int
    run_ids: list[str]
    episodes: list[EpisodeRepro]
    seconds: float
    which: Fields = Fields()

    @property
    def ok(self) -> bool:
        return all(e.identical for e in self.episodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "check": "repro",
            "ok": self.ok,
            "baseline": self.baseline,
            "repeat": self.repeat,
            "run_ids": self.run_ids,
            "ignored": list(self.which.ignored),
            "only": list(self.which.only),
            "seconds": round(self.seconds, 3),
            "episodes": [
                {
                    "episode_id": e.episode_id,
                    "identical": e.identical,
                    "outcomes": e.outcomes,
                    "fields_compared": e.compared,
                    "differing": e.differing,
                    "missing": e.missing,
                    "errors": e.errors,
                }
                for e in self.episodes
            ],
        }


async def run_repro(
    controller: Controller,
    manifests: list[Manifest],
    baseline: Baseline,
    *,
    repeat: int,
    parallel: int = 1,
    which: Fields = Fields(),
) -> ReproReport:
    """Run ``manifests`` ``repeat`` times (``parallel`` runs at once) and compare ``which``
    fields of their records."""
    started = time.monotonic()
    base = time.strftime("repro-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    run_ids = [f"{base}-{i + 1}" for i in range(repeat)]
    gate = asyncio.Semaphore(max(parallel, 1))

    async def one(run_id: str) -> RunResult:
        async with gate:
            return await controller.run(manifests, baseline, run_id=run_id)

    results = await asyncio.gather(*(one(r) for r in run_ids))
    episodes = [
        _compare(controller.store, m.episode_id, run_ids, results, which) for m in manifests
    ]
    seconds = time.monotonic() - started
    return ReproReport(baseline.digest, repeat, run_ids, episodes, seconds, which)


def _compare(
    store: Store, eid: str, run_ids: list[str], results: list[RunResult], which: Fields
) -> EpisodeRepro:
    records, outcomes, missing, errors = [], [], [], []
    for run_id, result in zip(run_ids, results, strict=True):
        record = store.get_record(run_id, eid)
        ended = [e for e in result.episodes if e.episode_id == eid]
        outcomes.append(ended[0].outcome.value if ended else "?")
        errors.append(ended[0].error if ended else None)
        if record is None:
            missing.append(run_id)
        else:
            records.append(record)
    compared = len(comparable(records[0], which)) if records else 0
    return EpisodeRepro(eid, outcomes, compared, differences(records, which), missing, errors)

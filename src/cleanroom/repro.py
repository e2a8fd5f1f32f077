"""``cleanroom check repro``: the same manifest, N fresh envs, the same result record?

Runs the manifests ``repeat`` times, each time as a run of its own (so every episode gets a fresh
env and a record of its own), then compares each episode's records field by field, leaving out
what is expected to change between runs: identities (run_id, attempt, env ids), timings, logs
(they carry timings and boot messages), the host, and how the env was started. Anything else
that differs is reported with its value in each run.
"""

from __future__ import annotations

import asyncio
import fnmatch
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from cleanroom.baseline.model import Baseline
from cleanroom.controller import Controller, RunResult
from cleanroom.manifest import Manifest
from cleanroom.store import Store

IGNORED = (
    "run_id",
    "attempt",
    "timings",
    "timings.*",
    "logs",
    "logs.*",
    "exit.duration_s",
    "provenance.env_id",
    "provenance.host",
    "provenance.host.*",
    "provenance.guest_boot_s",
    "provenance.start",
    "provenance.start_note",
    "provenance.template",
    "provenance.group.snapshot",  # a group's warm state is made anew each run (its RAM differs)
    "provenance.group.snapshot_id",
    "provenance.group.digest",
    "provenance.group.parent_env",
    "provenance.group.*_s",
    "verdict.verifier.env_id",
)
"""Dotted paths (fnmatch patterns) left out of the comparison."""
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


def comparable(record: dict[str, Any], ignored: tuple[str, ...] = IGNORED) -> dict[str, Any]:
    """The record's leaves without the ignored paths."""
    return {
        path: value
        for path, value in flatten(record).items()
        if not any(fnmatch.fnmatchcase(path, pattern) for pattern in ignored)
    }


def differences(
    records: list[dict[str, Any]], ignored: tuple[str, ...] = IGNORED
) -> dict[str, list[Any]]:
    """Paths whose values are not the same in every record, with each record's value."""
    flat = [comparable(r, ignored) for r in records]
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
        return not self.differing and not self.missing


@dataclass
class ReproReport:
    baseline: str
    repeat: int
    run_ids: list[str]
    episodes: list[EpisodeRepro]
    seconds: float

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
            "ignored": list(IGNORED),
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
) -> ReproReport:
    """Run ``manifests`` ``repeat`` times (``parallel`` runs at once) and compare."""
    started = time.monotonic()
    base = time.strftime("repro-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    run_ids = [f"{base}-{i + 1}" for i in range(repeat)]
    gate = asyncio.Semaphore(max(parallel, 1))

    async def one(run_id: str) -> RunResult:
        async with gate:
            return await controller.run(manifests, baseline, run_id=run_id)

    results = await asyncio.gather(*(one(r) for r in run_ids))
    episodes = [_compare(controller.store, m.episode_id, run_ids, results) for m in manifests]
    return ReproReport(baseline.digest, repeat, run_ids, episodes, time.monotonic() - started)


def _compare(store: Store, eid: str, run_ids: list[str], results: list[RunResult]) -> EpisodeRepro:
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
    compared = len(comparable(records[0])) if records else 0
    return EpisodeRepro(eid, outcomes, compared, differences(records), missing, errors)

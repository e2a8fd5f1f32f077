"""``cleanroom replay``: run an episode again in a fresh env from the same baseline, and say
where (if anywhere) it came out differently.

A **session** is replayed from its durable transcript (``sessions.transcript``), in order: each
command (argv, cwd, user) is run again and its exit status and the sha256 of its stdout and
stderr are compared with the step's; each file read (``get``) is read again and its digest
compared; a file write (``put``) is written again from the bytes the command log kept
(``content_log``: up to 1 MiB, never a secret) or given (``contents``, by sha256), else
reported ``skipped`` with the reason (what follows may then diverge for that reason).
Background commands, artifacts, forks and the finish are not steps of the guest's state and
are skipped. Environment variable *values* were never recorded
(names only), so a command that needed a secret replays without it.

A **batch** episode is run again from its manifest (rebuilt from the record, and checked
against the record's ``manifest_digest``; or given) in a new run, and the record fields that
should not depend on time or the host are compared (``DETERMINISTIC``).

The first step or field that differs is where the trajectory depended on something other than
its inputs: the clock, randomness, leftovers, the network.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Driver
from cleanroom.errors import CheckError, GuestOperationError
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.statements import TRANSCRIPT_LOG
from cleanroom.ledger import Ledger
from cleanroom.sessions import AsyncSession
from cleanroom.sessions.transcript import COMMANDS_LOG

DETERMINISTIC = (
    "outcome",
    "reward",
    "terminated",
    "truncated",
    "info",
    "metrics",
    "exit.code",
    "exit.signal",
    "exit.timed_out",
    "artifacts",
    "verdict",
)
SKIPPED_OPS = {"spawn", "artifact", "finish", "expired", "fork"}


@dataclass
class Step:
    """One step of the original, replayed: ``same`` (None: not compared) and why not."""

    step: int
    op: str
    same: bool | None
    detail: str = ""


@dataclass
class ReplayReport:
    run_id: str  # the original's
    episode_id: str
    replay_run_id: str
    kind: str  # "session" | "batch"
    steps: list[Step] = field(default_factory=list)

    @property
    def diverged_at(self) -> Step | None:
        return next((s for s in self.steps if s.same is False), None)

    @property
    def identical(self) -> bool:
        return self.diverged_at is None


def _stored_log(store: Any, run_id: str, record: dict[str, Any], name: str) -> bytes | None:
    """The bytes of the record's log ``name`` as stored, if they match the record's digest
    (None: not listed, missing or altered)."""
    entry = next((e for e in record.get("logs") or [] if e.get("name") == name), None)
    if entry is None:
        return None
    raw = store.get_bytes(run_id, record["episode_id"], entry.get("path") or f"logs/{name}")
    ok = raw is not None and _digest(raw) == entry.get("sha256")
    return raw if ok else None


def transcript_of(store: Any, run_id: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The durable transcript of a session's record (CheckError if it has none)."""
    if not any(e.get("name") == TRANSCRIPT_LOG for e in record.get("logs") or []):
        raise CheckError(f"episode {record.get('episode_id')} has no transcript: not a session")
    raw = _stored_log(store, run_id, record, TRANSCRIPT_LOG)
    if raw is None:
        raise CheckError(f"the transcript of {record['episode_id']} is missing or altered")
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def kept_writes(
    store: Any, run_id: str, record: dict[str, Any], steps: list[dict[str, Any]]
) -> dict[str, bytes]:
    """The bytes of the session's file writes that its command log kept, by sha256 (each
    checked against its step; none if the log is missing or altered)."""
    raw = _stored_log(store, run_id, record, COMMANDS_LOG)
    if raw is None:
        return {}
    kept: dict[str, bytes] = {}
    for s in steps:
        span = s.get("content_log") if s.get("op") == "put" else None
        if not isinstance(span, dict):
            continue
        start, size = span.get("offset"), span.get("size")
        if not isinstance(start, int) or not isinstance(size, int) or start < 0 or size < 0:
            continue
        data = raw[start : start + size]
        if _digest(data) == s.get("sha256"):
            kept[_digest(data)] = data
    return kept


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def replay_steps(
    sb: AsyncSession, steps: list[dict[str, Any]], contents: dict[str, bytes] | None = None
) -> list[Step]:
    """Each step of ``steps`` again in ``sb``, compared (see the module docstring)."""
    out: list[Step] = []
    for s in steps:
        n, op = int(s.get("step", 0)), str(s.get("op"))
        if op == "exec" and not s.get("background"):
            out.append(await _exec(sb, n, s))
        elif op == "get":
            try:
                data = await sb.files.read(s["path"])
            except GuestOperationError as exc:  # gone in the replay: that is the answer
                out.append(Step(n, op, False, f"read {s['path']}: {exc}"))
                continue
            same = _digest(data) == s.get("sha256")
            out.append(Step(n, op, same, "" if same else f"{s['path']}: other bytes"))
        elif op == "put":
            content = (contents or {}).get(str(s.get("sha256")))
            if content is None:
                why = s.get("content_withheld") or "the transcript keeps only its digest"
                out.append(Step(n, op, None, f"skipped: {why}"))
                continue
            await sb.files.write(s["path"], content)
            out.append(Step(n, op, True, "written again"))
        else:
            why = "background" if op == "exec" else op
            out.append(Step(n, op, None, f"skipped ({why})"))
    return out


async def _exec(sb: AsyncSession, n: int, s: dict[str, Any]) -> Step:
    r = await sb.commands.run(list(s["argv"]), cwd=s.get("cwd"), user=s.get("user"))
    raw = r.raw
    got = {
        "exit_code": r.exit_code,
        "signal": r.signal,
        "stdout": _digest(raw.stdout if raw is not None else r.stdout.encode()),
        "stderr": _digest(raw.stderr if raw is not None else r.stderr.encode()),
    }
    diffs = []
    for key in ("exit_code", "signal"):
        if got[key] != s.get(key):
            diffs.append(f"{key} {s.get(key)} -> {got[key]}")
    for stream in ("stdout", "stderr"):
        span = s.get(f"{stream}_log") or {}
        if s.get(f"{stream}_truncated"):
            continue  # only a prefix was kept: not comparable
        if span.get("sha256") != got[stream]:
            diffs.append(f"{stream} differs")
    return Step(n, "exec", not diffs, "; ".join(diffs))


def manifest_of(record: dict[str, Any]) -> Manifest:
    """The batch episode's manifest rebuilt from its record; CheckError unless its digest is
    the record's ``manifest_digest`` (a manifest with limits, secrets or a verifier the record
    does not hold must be given instead)."""
    fields = {k: record[k] for k in ("episode_id", "seed", "policy", "task") if k in record}
    manifest = Manifest.model_validate(fields)
    want = (record.get("provenance") or {}).get("manifest_digest")
    if want is not None and manifest.digest() != want:
        raise CheckError(
            f"episode {record['episode_id']}: its manifest cannot be rebuilt from the record "
            "(limits, secrets, a verifier?): pass the manifests file"
        )
    return manifest


def compare_records(old: dict[str, Any], new: dict[str, Any]) -> list[Step]:
    """The deterministic fields of two records of one episode, one ``Step`` each."""
    out = []
    for n, name in enumerate(DETERMINISTIC, 1):
        a, b = _field(old, name), _field(new, name)
        same = a == b
        out.append(Step(n, name, same, "" if same else f"{a!r} -> {b!r}"))
    return out


def _field(record: dict[str, Any], name: str) -> Any:
    value: Any = record
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if name == "artifacts":
        return sorted((a.get("name"), a.get("sha256")) for a in value or [])
    return value


async def replay(
    run_id: str,
    episode_id: str,
    *,
    store: Any = None,
    driver: Driver | str | None = None,
    ledger: Ledger | None = None,
    replay_run_id: str | None = None,
    contents: dict[str, bytes] | None = None,
    manifest: Manifest | None = None,
    baseline: Baseline | None = None,
) -> ReplayReport:
    """Replay ``episode_id`` of ``run_id`` (from ``store``: a ``Store``, folder or URL) on
    ``driver`` (default: the one its record names) in a new run; the step-by-step report."""
    from secrets import token_hex

    from cleanroom.api import arun
    from cleanroom.sessions import session
    from cleanroom.store import Store, open_store

    st = store if isinstance(store, Store) else open_store(store)
    record = st.get_record(run_id, episode_id)
    if record is None:
        raise CheckError(f"episode {episode_id} of run {run_id} has no durable record")
    prov = record.get("provenance") or {}
    digest, drv = prov.get("baseline"), driver or prov.get("driver") or "qemu"
    if not isinstance(digest, str):
        raise CheckError(f"the record of {episode_id} names no baseline digest")
    if baseline is not None and baseline.digest != digest:
        raise CheckError(f"{episode_id} ran on {digest}, not on the given {baseline.digest}")
    base: Baseline | str = baseline or digest  # the same baseline, by its digest
    new_run = replay_run_id or f"replay-{token_hex(4)}"
    is_session = any(e.get("name") == TRANSCRIPT_LOG for e in record.get("logs") or [])
    report = ReplayReport(run_id, episode_id, new_run, "session" if is_session else "batch")
    if is_session:
        steps = transcript_of(st, run_id, record)
        contents = {**kept_writes(st, run_id, record, steps), **(contents or {})}
        async with session(
            base,
            driver=drv,
            ledger=ledger,
            store=st,
            seed=record.get("seed", 0),
            run_id=new_run,
            episode_id=episode_id,
        ) as sb:
            report.steps = await replay_steps(sb, steps, contents)
            sb.finish(reward=0.0, info={"replay_of": f"{run_id}/{episode_id}"})
        return report
    if not isinstance(drv, str) or not (store is None or isinstance(store, str | Path)):
        raise CheckError("a batch episode is replayed by this home's controller: a driver name")
    result = await arun(
        [manifest or manifest_of(record)],
        baseline=base,
        store=store,
        run_id=new_run,
        driver=drv,
    )
    again = st.get_record(new_run, episode_id)
    if again is None:
        [ep] = result.episodes
        raise CheckError(f"the replay of {episode_id} ended {ep.outcome} with no record")
    report.steps = compare_records(record, again)
    return report

"""Attestation benchmark: signing cost per episode against its own export, and audit verify time.

1. A run of N episodes on the fake driver (the real C agent as a host process; each episode
   writes an artifact, two logs, its record): per episode, the time to build and sign its two
   statements (episode + destroy), the time to write the two envelopes, and the whole
   ``export_episode`` (artifacts, logs, attestation, record; the same episode's own export,
   the same-run reference). Ratios of the p50s say what signing adds to the export.
2. ``audit verify`` of a run of ``--audit-episodes`` episodes (default 1,000) on the same
   driver, timed end to end (``verify_run`` over the local store: every signature, digest,
   the chain), several times.
3. One ledger event appended to its run's hash chain against the plain insert it replaced
   (the same ledger, the same run).

    python bench/attest.py [--runs 40] [--audit-episodes 1000] [--audit-runs 3]
Results: bench/results/attest.txt
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stats import Table, p50, parser, write

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.checks.audit import verify_run
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence import export, keys
from cleanroom.evidence.manifest import Manifest
from cleanroom.ledger import Ledger
from cleanroom.lifecycle import episode as episode_mod
from cleanroom.lifecycle import lease
from cleanroom.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import make_fake_baseline  # noqa: E402


class Timings:
    """Wraps the functions whose cost we want, keeping each call's seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        kept = self.seconds.setdefault(label, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                kept.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def wrap_async(self, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        kept = self.seconds.setdefault(label, [])

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                kept.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def wrap_puts(self, store: LocalStore) -> None:
        """``put_bytes`` of an envelope (``*.dsse.json``), timed apart from the others."""
        inner = store.put_bytes
        kept = self.seconds.setdefault("write the two envelopes", [])

        def put_bytes(run_id: str, eid: str, rel: str, data: bytes) -> Any:
            start = time.perf_counter()
            try:
                return inner(run_id, eid, rel, data)
            finally:
                if rel.endswith(".dsse.json"):
                    kept.append(time.perf_counter() - start)

        store.put_bytes = put_bytes  # type: ignore[method-assign]


def manifests(n: int) -> list[Manifest]:
    return [
        Manifest.model_validate({"episode_id": f"e{i:04d}", "seed": i, "policy": {"id": "b"}})
        for i in range(n)
    ]


async def a_run(tmp: Path, n: int, parallel: int, timings: Timings | None) -> LocalStore:
    ledger = Ledger(tmp / "ledger.db")
    store = LocalStore(tmp / "store")
    if timings is not None:
        timings.wrap_puts(store)
    ctl = Controller(
        FakeDriver(run_root=tmp / "run"),
        ledger,
        store,
        options=RunOptions(parallel=parallel, staging_dir=tmp / "staging", spares=0),
    )
    try:
        result = await ctl.run(manifests(n), make_fake_baseline(tmp), run_id="bench")
    finally:
        ledger.close()
    bad = [e for e in result.episodes if e.outcome.value != "completed"]
    assert not bad, bad[:3]
    return store


def pairs(seconds: list[float]) -> list[float]:
    """Two calls per episode (episode + destroy statement): their sums, per episode."""
    return [a + b for a, b in zip(seconds[::2], seconds[1::2], strict=False)]


def ledger_events(n: int) -> tuple[list[float], list[float]]:
    """Seconds per chained ``Ledger.event`` and per plain insert, ``n`` of each, interleaved."""
    chained, plain = [], []
    insert = (
        "INSERT INTO events (ts, run_id, episode_id, env_id, kind, data) VALUES (?, ?, ?, ?, ?, ?)"
    )
    with tempfile.TemporaryDirectory() as d, Ledger(Path(d) / "l.db") as led:
        for i in range(n):
            t0 = time.perf_counter()
            led.event("tick", run_id="r", n=i)
            t1 = time.perf_counter()
            led._write("plain", insert, (time.time(), "p", None, None, "tick", f'{{"n": {i}}}'))
            plain.append(time.perf_counter() - t1)
            chained.append(t1 - t0)
    return chained, plain


def main() -> None:
    p = parser(__doc__ or "", "attest.txt", 40)
    p.add_argument("--audit-episodes", type=int, default=1000)
    p.add_argument("--audit-runs", type=int, default=3)
    p.add_argument("--parallel", type=int, default=2)
    args = p.parse_args()
    keys.signing_key()  # made before timing (first use)
    timings = Timings()
    timings.wrap(export, "_envelope", "sign the episode statement")
    timings.wrap(lease.EnvLease, "_sign_proof", "sign the destroy statement")
    timings.wrap(episode_mod, "export_episode", "export_episode (reference)")
    timings.wrap_async(lease.EnvLease, "_destroy", "destroy + confirm + proof")
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        asyncio.run(a_run(Path(d), args.runs, args.parallel, timings))
        small_s = time.perf_counter() - start
    s = timings.seconds
    signing = [
        a + b
        for a, b in zip(
            s["sign the episode statement"], s["sign the destroy statement"], strict=False
        )
    ]
    writes = pairs(s["write the two envelopes"])
    exported = s["export_episode (reference)"]
    both = [a + b for a, b in zip(signing, writes, strict=False)]
    close = p50(exported) + p50(s["destroy + confirm + proof"])
    table = Table(("n", "p50", "p95", "min", "max"), 34)
    lines = [
        f"# bench/attest.py — {time.strftime('%Y-%m-%d %H:%M')} — fake driver (real C agent), "
        f"{os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, parallel {args.parallel}",
        f"1. {args.runs} episodes ({small_s:.1f} s): per episode",
        table.header("(ms)"),
        table.row("sign the episode statement", s["sign the episode statement"]),
        table.row("sign the destroy statement", s["sign the destroy statement"]),
        table.row("both signatures", signing),
        table.row("write the two envelopes", writes),
        table.row("export_episode (reference)", exported),
        table.row("destroy + confirm + proof", s["destroy + confirm + proof"]),
        f"  close = export + destroy, p50s: {close * 1000:.1f} ms",
        table.ratio_row("signing / export_episode (p50)", signing, exported),
        table.ratio_row("signing + writes / export (p50)", both, exported),
        f"  signing / close (p50s)           {p50(signing) / close:.3f}",
        f"  signing + writes / close (p50s)  {p50(both) / close:.3f}",
    ]
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        store = asyncio.run(a_run(Path(d), args.audit_episodes, args.parallel, None))
        made_s = time.perf_counter() - start
        trusted = [keys.signing_key().public_key()]
        verify_s = []
        for _ in range(args.audit_runs):
            t0 = time.perf_counter()
            report = verify_run(store, "bench", trusted)
            verify_s.append(time.perf_counter() - t0)
            assert report.ok and report.records == args.audit_episodes, report.problems[:3]
    chained, plain = ledger_events(2000)
    lines += [
        f"2. audit verify of a {args.audit_episodes}-episode run ({report.events} chained events, "
        f"made in {made_s:.0f} s), {args.audit_runs} times",
        table.header("(ms)"),
        table.row("audit verify (whole run)", verify_s),
        f"  per episode p50 {min(verify_s) / args.audit_episodes * 1000:.2f} ms (best run)",
        "3. a ledger event: chained (BEGIN IMMEDIATE, the run's tip, insert) vs a plain insert",
        f"  chained p50 {p50(chained) * 1e6:.0f} us, plain insert (reference) p50 "
        f"{p50(plain) * 1e6:.0f} us, {len(chained)} each: +{(p50(chained) - p50(plain)) * 1e6:.0f}"
        " us per event; each episode adds 4 (its env's intent, creation, destruction; its end)",
        f"load average (1 min) at the end {os.getloadavg()[0]:.1f}",
        "targets: signing <= 5% of the episode's close; audit verify of 1,000 episodes <= 10 s",
    ]
    write(args.out, lines)


if __name__ == "__main__":
    main()

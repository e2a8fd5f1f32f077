"""A first run's snapshot template build is said out loud: progress line, run event, report mark.

It used to take ~10 s silently, so the first episodes showed a 10 s provision and the summary's
p50 looked broken. Unit level here (events, progress, report); ``tests/vm/test_first_run.py``
builds a real template.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

from rich.console import Console

from cleanroom.core import events
from cleanroom.ledger import Ledger
from cleanroom.observe.progress import RunProgress
from cleanroom.observe.report import run_report_json, summary_table
from cleanroom.store import LocalStore

BUILT = {"key": "k", "baseline": "tiny", "digest": "sha256:" + "ab" * 32}


def test_emit_reaches_the_hook_of_the_run_in_tasks_and_threads() -> None:
    """``cleanroom.core.events`` carries a driver's events to the run's hook through asyncio tasks
    and ``to_thread`` (where a driver works), and to nothing outside a run."""
    seen: list[tuple[str, dict[str, Any]]] = []
    events.emit("template_building", **BUILT)  # no run: dropped

    async def main() -> None:
        with events.hooked(lambda kind, data: seen.append((kind, data))):
            await asyncio.create_task(asyncio.to_thread(events.emit, "template_built", seconds=1))
        events.emit("template_built", seconds=2)  # the run is over

    asyncio.run(main())
    assert seen == [("template_built", {"seconds": 1})]


def test_progress_says_a_template_is_being_built_even_without_step_lines() -> None:
    buffer = io.StringIO()
    progress = RunProgress(Console(file=buffer, force_terminal=False, width=200), lines=False)
    progress.on_event("template_building", BUILT)
    progress.on_event("template_built", {**BUILT, "seconds": 9.84})
    progress.on_event("template_failed", {**BUILT, "error": "template build failed: [boom]"})
    text = buffer.getvalue()
    assert "template build failed: [boom] (with start=auto, envs of tiny boot cold)" in text
    assert "building snapshot template for tiny (sha256:abababababab) (first run only" in text
    assert "snapshot template for tiny ready in 9.8 s" in text


def _record(store: LocalStore, eid: str, start: float, end: float) -> None:
    phases = {"provision": {"start": start, "end": end}}
    record = {"episode_id": eid, "policy": {"id": "p"}, "timings": {"phases": phases}}
    store.put_record("r", eid, record)


def test_the_report_marks_the_episodes_that_waited_for_the_build(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with Ledger(tmp_path / "ledger.db") as ledger:
        ledger.start_run("r", controller_id="c", baseline="b", driver="qemu", parallel=2, meta={})
        for eid in ("early", "late"):
            ledger.episode_queued("r", eid, 1)
        ledger.event("template_built", run_id="r", **BUILT, seconds=5.0)
        built_at = ledger.events("r", "template_built")[0].ts
        _record(store, "early", built_at - 5.5, built_at + 0.2)  # provisioned across the build
        _record(store, "late", built_at + 1.0, built_at + 1.1)
        report = run_report_json("r", ledger, store)
        table = summary_table("r", ledger, store)
    marks = {row["episode_id"]: row["waited_for_template"] for row in report["episodes"]}
    assert marks == {"early": True, "late": False}
    assert report["summary"]["waited_for_template"] == 1
    assert report["summary"]["template_builds"] == [
        {"baseline": "tiny", "digest": BUILT["digest"], "seconds": 5.0}
    ]
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    assert "waited for the tiny template build (first run only)" in out.getvalue()

"""The first run of a baseline on a host builds its snapshot template, and says so (real QEMU).

Protects issue 14's "silent 10 s": the run's events, the ledger and the report all name the
build, and only the first run pays it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.baseline.conftest import clone_baseline

import cleanroom
from cleanroom.core.baseline_model import Baseline
from cleanroom.ledger import Ledger
from cleanroom.observe.report import run_report_json
from cleanroom.store import open_store

pytestmark = pytest.mark.vm


def test_a_first_run_announces_and_marks_its_template_build(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("CLEANROOM_HOME", str(home))  # no template for tiny here yet
    clone_baseline(tiny_baseline, home)
    items = [{"episode_id": f"f{i}", "seed": i, "policy": {"id": "p"}} for i in range(3)]
    seen: list[tuple[str, dict[str, Any]]] = []

    def run(run_id: str) -> None:
        result = cleanroom.run(
            items,
            baseline=tiny_baseline.digest,
            run_id=run_id,
            on_event=lambda kind, data: seen.append((kind, data)),
        )
        assert [e.outcome.value for e in result.episodes] == ["completed"] * 3, result.episodes

    run("first")
    kinds = [kind for kind, _ in seen]
    assert kinds.count("template_building") == 1 and kinds.count("template_built") == 1, kinds
    assert kinds.index("template_building") < kinds.index("template_built")
    with Ledger() as ledger:
        report = run_report_json("first", ledger, open_store(None))
        assert [e.kind for e in ledger.events("first", "template_built")] == ["template_built"]
    assert report["summary"]["template_builds"][0]["baseline"] == "tiny"
    assert report["summary"]["waited_for_template"] >= 1

    seen.clear()
    run("second")  # the template exists now: nothing to build, nothing to mark
    assert not [kind for kind, _ in seen if kind.startswith("template_")]
    with Ledger() as ledger:
        again = run_report_json("second", ledger, open_store(None))
    summary = again["summary"]
    assert summary["template_builds"] == [] and summary["waited_for_template"] == 0

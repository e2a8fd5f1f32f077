"""The fuzz targets in ``make test``: the committed corpus and crash reproducers replayed, and a
brief coverage-guided run of every target (atheris; ``make fuzz`` runs 1,000,000 inputs each);
the property tests are in ``test_properties.py``. Protects issue 15 §1/§10: no guest-facing
parser raises anything but its typed errors (on the old code a deep header raised
RecursionError, a lone surrogate name UnicodeEncodeError at os.open, a NaN in metrics failed at
export, and an EXEC answered by DONE alone raised UnboundLocalError)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cleanroom.agent import protocol

from . import targets

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
CRASHES = HERE / "crashes"
BRIEF_S = int(os.environ.get("CLEANROOM_FUZZ_BRIEF_S", "8"))  # per target; 6 targets < 2 min


def _inputs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_corpus_replays_with_typed_errors_only(target: str) -> None:
    """The seeds and what 1,000,000-input runs of ``make fuzz`` kept (tests/fuzz/corpus/)."""
    inputs = _inputs(CORPUS / target)
    assert inputs
    for path in inputs:
        targets.check(target, path.read_bytes())


@pytest.mark.parametrize("path", _inputs(CRASHES), ids=lambda p: p.name)
def test_crash_reproducers_are_fixed(path: Path) -> None:
    """A committed reproducer of a target with a ``KNOWN`` untyped error (issue 15 §9, owned by
    the operator-input item) is an expected failure until that lands; then it must pass."""
    target = path.name.split("-")[0]
    if target in targets.KNOWN:
        try:
            targets.check(target, path.read_bytes())
        except targets.KNOWN[target] as exc:
            pytest.xfail(f"known, issue 15 §9: {type(exc).__name__}")
    else:
        targets.check(target, path.read_bytes())


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_brief_coverage_guided_run(target: str, tmp_path: Path) -> None:
    """libFuzzer exits non-zero (and writes the input) on the first untyped exception."""
    work = tmp_path / "corpus"
    work.mkdir()
    command = [
        sys.executable,
        str(HERE / "fuzz.py"),
        target,
        f"-max_total_time={BRIEF_S}",
        "-rss_limit_mb=2048",
        "-max_len=65536",
        f"-artifact_prefix={tmp_path}/",
        str(work),
        str(CORPUS / target),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BRIEF_S + 60)
    crashes = [p.name for p in tmp_path.iterdir() if p.name != "corpus"]
    assert done.returncode == 0 and not crashes, done.stderr[-3000:]


def test_limits_are_consistent() -> None:
    """Chunks fit in a frame, and a whole result fits in the chunks the agent sends."""
    assert protocol.CHUNK <= protocol.DEFAULT_MAX_BODY
    assert protocol.MAX_NAME_PART * protocol.MAX_NAME_PARTS >= protocol.MAX_NAME
    assert protocol.MAX_HEADER < protocol.RESULT_MAX_BYTES

"""The code-repair example's episode and verifier scripts, run on the host (no VM)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cleanroom.evidence.manifest import load_manifests

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "code-repair"
EXPECTED = {0: (True, 1.0), 1: (False, 5 / 7), 2: (True, 1.0), 3: (False, 5 / 7)}


def run(script: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, str(script)], env={**os.environ, **env}, check=True)


@pytest.mark.parametrize("seed", sorted(EXPECTED))
def test_candidates_and_verdicts(tmp_path: Path, seed: int) -> None:
    episode, verifier = tmp_path / "episode", tmp_path / "verifier"
    (episode / "out").mkdir(parents=True)
    (episode / "manifest.json").write_text(json.dumps({"seed": seed, "task": {}}))
    run(
        EXAMPLE / "episode" / "solve.py",
        {"CLEANROOM_DIR": str(episode), "CODE_REPAIR_HOME": str(EXAMPLE)},
    )
    result = json.loads((episode / "result.json").read_text())
    assert result["reward"] == 1.0  # every candidate passes the public tests
    (verifier / "input").mkdir(parents=True)
    shutil.copytree(episode / "out", verifier / "input" / "artifacts")
    env = {"CLEANROOM_DIR": str(verifier), "VERIFIER_HOME": str(EXAMPLE)}
    run(EXAMPLE / "verifier" / "verify.py", env)
    first = (verifier / "verdict.json").read_bytes()
    verdict = json.loads(first)
    assert (verdict["pass"], verdict["score"]) == pytest.approx(EXPECTED[seed])
    assert verdict["details"]["candidate"] == result["info"]["candidate"]
    run(EXAMPLE / "verifier" / "verify.py", env)
    assert (verifier / "verdict.json").read_bytes() == first  # deterministic


def test_an_episode_cannot_smuggle_tests(tmp_path: Path) -> None:
    files = tmp_path / "input" / "artifacts" / "files"
    (files / "tests").mkdir(parents=True)
    (files / "tests" / "test_hidden.py").write_text("")  # would delete the hidden tests
    (files / "calc").mkdir()
    (files / "calc" / "new.py").write_text("")  # not a file of the repository
    run(
        EXAMPLE / "verifier" / "verify.py",
        {"CLEANROOM_DIR": str(tmp_path), "VERIFIER_HOME": str(EXAMPLE)},
    )
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["pass"] is False and verdict["score"] == 0.0
    assert verdict["details"]["refused"] == ["calc/new.py", "tests/test_hidden.py"]


def test_manifests_name_the_verifier() -> None:
    manifests = load_manifests(EXAMPLE / "manifests.jsonl")
    assert len(manifests) == 8
    for m in manifests:
        assert (
            m.verifier is not None and m.verifier.baseline == "examples/code-repair/verifier.toml"
        )
        assert not m.verifier.in_env

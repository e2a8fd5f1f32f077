"""What RUN gives the entrypoint and how a failed entrypoint is told (``lifecycle.run``).

Protects the record's error text and the entrypoint's documented variables: a failed
entrypoint's error says its exit code or the signal that ended it (an operator's first clue),
and the entrypoint gets ``CLEANROOM_EPISODE_ID`` and ``CLEANROOM_SEED`` from the manifest. The
fake driver: the real native agent and RUN path, no VM. Mutation testing found each
unchecked (any exit text, renamed or missing variables passed).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Env
from cleanroom.drivers.fake import FakeDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.lifecycle.run import run_in_env

from ..conftest import make_fake_baseline
from ..vmkit import request

ENTRY = """\
import json, os, signal, sys
root = os.environ["CLEANROOM_DIR"]
with open(root + "/manifest.json") as f:
    task = json.load(f)["task"]
if "exit" in task:
    sys.exit(task["exit"])
if "signal" in task:
    os.kill(os.getpid(), task["signal"])
names = ("CLEANROOM_EPISODE_ID", "CLEANROOM_SEED")
with open(root + "/result.json", "w") as f:
    json.dump({"reward": 1.0, "info": {n: os.environ.get(n) for n in names}}, f)
"""


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[Env, Baseline]]:
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)
    baseline = make_fake_baseline(tmp_path, script)
    live = await FakeDriver(run_root=tmp_path / "run").create(request(baseline))
    yield live, baseline
    assert (await live.aclose()).confirmed_absent


async def run(
    env: tuple[Env, Baseline], tmp: Path, **task: Any
) -> tuple[Outcome, str | None, bytes | None]:
    live, baseline = env
    manifest = Manifest.model_validate(
        {"episode_id": "ep-7", "seed": 4242, "policy": {"id": "p"}, "task": task}
    )
    limits = manifest.limits.merged_over(baseline.limits)
    outcome, error, output = await run_in_env(
        live, manifest, baseline, limits, tmp / "staging", {}, collect_grace_s=10
    )
    return outcome, error, output.result_raw if output is not None else None


async def test_a_failed_entrypoint_says_its_exit_code(
    env: tuple[Env, Baseline], tmp_path: Path
) -> None:
    outcome, error, _ = await run(env, tmp_path, exit=3)
    assert (outcome, error) == (Outcome.EPISODE_ERROR, "entrypoint failed (exit code 3)")


async def test_a_killed_entrypoint_says_the_signal(
    env: tuple[Env, Baseline], tmp_path: Path
) -> None:
    outcome, error, _ = await run(env, tmp_path, signal=9)
    assert (outcome, error) == (Outcome.EPISODE_ERROR, "entrypoint failed (signal 9)")


async def test_the_entrypoint_gets_its_episode_id_and_seed(
    env: tuple[Env, Baseline], tmp_path: Path
) -> None:
    outcome, error, raw = await run(env, tmp_path)
    assert outcome is Outcome.COMPLETED, error
    assert raw is not None
    info = json.loads(raw)["info"]
    assert info == {"CLEANROOM_EPISODE_ID": "ep-7", "CLEANROOM_SEED": "4242"}

"""Secret files in the guest live no longer than they should (issue 21 §2).

Protects the guest agent: a secret's file under ``/run/cleanroom/secrets/`` is removed when
the entrypoint ends (checked in the env before it is destroyed: destroying it would hide a file
never removed), and one with ``lifetime_s`` is removed while the entrypoint still runs. The fake
driver: the real agent and RUN path, the guest root on the host where the test can look.
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

SECRETS = {"SHORT_LIVED": "short-lived-value-1", "WHOLE_RUN": "whole-run-value-22"}
ENTRY = """\
import json, os, time
root = os.environ["CLEANROOM_DIR"]
secrets = root + "/secrets/"
info = {"at_start": sorted(os.listdir(secrets))}
with open(root + "/manifest.json") as f:
    wait = json.load(f)["task"].get("wait_for_expiry")
end = time.monotonic() + 20
while wait and os.path.exists(secrets + "SHORT_LIVED") and time.monotonic() < end:
    time.sleep(0.02)
info["later"] = sorted(os.listdir(secrets))
info["env_kept"] = os.environ.get("SHORT_LIVED") == "short-lived-value-1"
with open(root + "/result.json", "w") as f:
    json.dump({"reward": 1.0, "info": info}, f)
"""


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[FakeDriver, Env, Baseline]]:
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)
    baseline = make_fake_baseline(tmp_path, script)
    driver = FakeDriver(run_root=tmp_path / "run")
    env = await driver.create(request(baseline))
    yield driver, env, baseline
    assert (await env.aclose()).confirmed_absent


async def run(
    env: tuple[FakeDriver, Env, Baseline], tmp: Path, secrets: list[Any], **task: Any
) -> Any:
    _, live, baseline = env
    manifest = Manifest.model_validate(
        {"episode_id": "e", "seed": 0, "policy": {"id": "p"}, "secrets": secrets, "task": task}
    )
    limits = manifest.limits.merged_over(baseline.limits)
    outcome, error, output = await run_in_env(
        live, manifest, baseline, limits, tmp / "staging", SECRETS, collect_grace_s=10
    )
    assert outcome is Outcome.COMPLETED, error
    assert output is not None and output.result_raw is not None
    return json.loads(output.result_raw)["info"]


def secrets_dir(env: tuple[FakeDriver, Env, Baseline]) -> Path:
    driver, live, _ = env
    return Path(driver.guest_prefix(live.env_id)) / "run" / "cleanroom" / "secrets"


async def test_secret_files_are_removed_when_the_entrypoint_ends(
    env: tuple[FakeDriver, Env, Baseline], tmp_path: Path
) -> None:
    info = await run(env, tmp_path, ["SHORT_LIVED", "WHOLE_RUN"])
    assert info["at_start"] == ["SHORT_LIVED", "WHOLE_RUN"]
    assert info["later"] == ["SHORT_LIVED", "WHOLE_RUN"]  # no lifetime: the whole run
    assert secrets_dir(env).is_dir() and list(secrets_dir(env).iterdir()) == []  # env alive


async def test_a_secret_with_a_lifetime_is_removed_while_the_entrypoint_runs(
    env: tuple[FakeDriver, Env, Baseline], tmp_path: Path
) -> None:
    secrets = [{"name": "SHORT_LIVED", "lifetime_s": 0.3}, "WHOLE_RUN"]
    info = await run(env, tmp_path, secrets, wait_for_expiry=True)
    assert info["at_start"] == ["SHORT_LIVED", "WHOLE_RUN"]
    assert info["later"] == ["WHOLE_RUN"]  # the entrypoint saw it go (it waits up to 20 s)
    assert info["env_kept"]  # the lifetime is the file's; the variable is the process's own
    assert list(secrets_dir(env).iterdir()) == []

"""Who owns an env the reaper finds on the host (issue 21 §3: mutants of ``reaper._claimed``).

Protects: an env is reaped only when its owner is gone — by its ledger row if it has one, else
by the owner record in its run folder: host, pid and creation time all count (a live pid that
started after the record was written is a reused pid, not the owner; another host's owner is
assumed alive). Each case kills mutants that dropped one of those fields.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.reaper import reap

from ..conftest import make_fake_baseline
from .test_reaper import dead_pid

YEAR_S = 86400 * 365


@pytest.fixture
async def host(tmp_path: Path) -> AsyncIterator[tuple[FakeDriver, Ledger, list[str]]]:
    """A fake driver, a ledger, and the envs a test made (destroyed after it)."""
    driver = FakeDriver(run_root=tmp_path / "run")
    made: list[str] = []
    with Ledger(tmp_path / "ledger.db") as ledger:
        yield driver, ledger, made
    for env_id in made:
        await driver.destroy(env_id)


async def make(driver: FakeDriver, made: list[str], tmp: Path, owner: Owner) -> str:
    request = EnvRequest(
        new_env_id(), make_fake_baseline(tmp / owner.controller_id), ResolvedLimits(), owner, 60
    )
    env = await driver.create(request)
    await env.session.aclose()
    made.append(env.env_id)
    return env.env_id


async def test_an_env_with_only_an_owner_file_is_reaped_only_when_that_owner_is_gone(
    host: tuple[FakeDriver, Ledger, list[str]], tmp_path: Path
) -> None:
    driver, ledger, made = host
    alive = await make(driver, made, tmp_path, Owner("me"))
    dead = await make(driver, made, tmp_path, Owner("gone", pid=dead_pid()))
    remote = await make(driver, made, tmp_path, Owner("far", pid=dead_pid(), host="elsewhere"))
    reused = await make(driver, made, tmp_path, Owner("reused"))  # our pid, an older record
    record = driver.run_dir(reused) / "owner.json"
    owner = json.loads(record.read_text())
    record.write_text(json.dumps({**owner, "created_at": time.time() - YEAR_S}))

    report = await reap(driver, ledger, staging_root=tmp_path / "staging")
    assert sorted(report.destroyed) == sorted([dead, reused]) and report.failed == []
    assert driver.exists(alive) and driver.exists(remote)
    assert not driver.exists(dead) and not driver.exists(reused)


async def test_an_env_with_a_ledger_row_on_another_host_is_left_alone(
    host: tuple[FakeDriver, Ledger, list[str]], tmp_path: Path
) -> None:
    driver, ledger, made = host
    owner = Owner("far", pid=dead_pid(), host="elsewhere")
    env_id = await make(driver, made, tmp_path, owner)
    ledger.start_run("r", controller_id="far", baseline="b", driver="fake", parallel=1, meta={})
    ledger.env_intent(
        env_id, run_id="r", episode_id=None, attempt=None, driver="fake", **owner.ledger_fields()
    )
    report = await reap(driver, ledger, staging_root=tmp_path / "staging")
    assert report.destroyed == [] and driver.exists(env_id)

"""``cleanroom serve --openenv`` on real QEMU microVMs: OpenEnv's client plays Gymnasium's own
CartPole-v1 inside VMs of ``examples/gym``; each session's episode has its record and no VM
outlives the session."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core", reason="openenv-core not installed")

from openenv.core import GenericEnvClient

from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.store import open_store

from ..vmkit import assert_gone
from .kit import Server, new_key

pytestmark = pytest.mark.vm
SPEC = Path(__file__).resolve().parents[2] / "examples" / "gym" / "baseline.toml"


def test_openenv_client_plays_cartpole_in_real_vms(tmp_path: Path) -> None:
    if not os.path.exists("/usr/bin/qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed (run `make setup`)")
    args = ["--driver", "qemu", "--template", f"gym={SPEC}",
            "--openenv", "cartpole=CartPole-v1@gym"]  # fmt: skip
    srv = Server(args, tmp_path / "serve.log")
    url = f"http://user:{new_key()}@127.0.0.1:{srv.port}/openenv/cartpole"
    try:
        with GenericEnvClient(base_url=url, message_timeout_s=300).sync() as env:
            result = env.reset(seed=3)
            total = 0.0
            while not result.done:
                result = env.step({"action": 1 if result.observation["obs"][2] > 0 else 0})
                total += result.reward or 0.0
            state: dict[str, Any] = env.state()
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    assert total == state["step_count"] > 0  # CartPole: +1 a step
    record = open_store(None).get_record(state["run_id"], state["cleanroom_episode_id"])
    assert record is not None and record["outcome"] == "completed"
    assert record["reward"] == total and record["info"]["terminated"] is True
    with Ledger() as ledger:
        envs = ledger.envs(run_id=state["run_id"])
    assert envs and all(e.confirmed_absent_at for e in envs)
    deadline = time.monotonic() + 10
    for e in envs:
        while time.monotonic() < deadline:
            try:
                assert_gone(QemuDriver(), e.env_id)
                break
            except AssertionError:
                time.sleep(0.1)
        assert_gone(QemuDriver(), e.env_id)

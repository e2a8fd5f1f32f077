"""The driver conformance suite: every driver (fake, gvisor, qemu) keeps the same promises.

Like Gymnasium's ``check_env``: a third-party driver passes when these pass with it in ``kit``.
Each check that leaves the env usable shares one env (a QEMU boot costs seconds under TCG);
each check that ends its env gets its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cleanroom.agent import native
from cleanroom.agent.connection import safe_relpath
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.states import Outcome
from cleanroom.errors import CommandFailed, EnvCrashed, FrameTooLarge, QuotaExceeded
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from .conftest import ISOLATION, Kit

ARTIFACT_SCRIPT = """
import os
root = os.environ["CLEANROOM_DIR"]
out = root + "/out"
os.makedirs(out + "/sub", exist_ok=True)
with open(out + "/ok.txt", "w") as f:
    f.write("ok")
with open(out + "/sub/deep.txt", "w") as f:
    f.write("deep")
os.symlink("/etc/passwd", out + "/passwd-link")
os.symlink("/", out + "/root-link")
with open(root + "/result.json", "w") as f:
    f.write('{"reward": 1.0}')
print("episode done")
"""


def assert_gone(kit: Kit, env_id: str) -> None:
    assert not kit.driver.exists(env_id)
    assert not kit.driver.alive(env_id)
    assert not hostproc.pids_with_marker(env_id)
    assert env_id not in kit.driver.list_owned()


async def test_create_exec_files_episode_then_destroy(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = await kit.create()
    env_id = env.env_id

    # create: the agent said HELLO; the env is visible on the host
    assert env.hello["agent_version"] == native.agent_version() and env.hello.get("kernel")
    assert env.hello["agent"] == "native"  # the one guest agent, on every driver
    assert env.info.driver == kit.driver.name
    assert env.info.isolation in ISOLATION[kit.name]
    assert kit.driver.describe()["isolation"] == env.info.isolation
    assert kit.driver.exists(env_id) and kit.driver.alive(env_id)
    assert env_id in kit.driver.list_owned()

    # exec: the exit code is data; stdout and stderr are kept apart
    result = await env.exec(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (result.exit_code, result.stdout, result.stderr) == (7, b"out\n", b"err\n")
    assert not result.ok
    with pytest.raises(CommandFailed):
        result.check()
    assert (await env.exec(["true"])).ok

    # put / get round trip, checked inside the guest too (qemu: through its bulk disk)
    assert ("bulk" in env.hello["features"]) == (kit.name == "qemu")
    blob = os.urandom(300 * 1024)
    path = f"{kit.scratch}/blob.bin"
    await env.put(path, blob)
    assert await env.get(path) == blob
    code = f"import hashlib; print(hashlib.sha256(open({path!r}, 'rb').read()).hexdigest())"
    inside = await env.exec([kit.python, "-c", code])
    assert inside.stdout.decode().strip() == hashlib.sha256(blob).hexdigest()

    # an episode: artifacts come back under safe names only, links are not followed
    staging = kit.tmp / "staging"
    request = {
        "manifest": {"episode_id": "conformance", "seed": 1},
        "entrypoint": [kit.python, "-c", ARTIFACT_SCRIPT],
        "timeout_s": 60,
        "env": {},
    }
    output = await env.run_episode(request, staging, quota_bytes=8 * 1024 * 1024)
    assert output.exit.exit_code == 0 and output.result_raw == b'{"reward": 1.0}'
    names = sorted(a.name for a in output.artifacts)
    assert names == ["ok.txt", "sub/deep.txt"]
    artifacts_dir = (staging / "artifacts").resolve()
    for artifact in output.artifacts:
        safe_relpath(artifact.name)
        assert artifact.path.resolve().is_relative_to(artifacts_dir)
        assert not artifact.path.is_symlink()
    assert (staging / "artifacts" / "ok.txt").read_bytes() == b"ok"
    staged = {str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()}
    assert staged == {"artifacts/ok.txt", "artifacts/sub/deep.txt"} | {
        "logs/stdout.log",
        "logs/stderr.log",
    }

    # an oversized frame from the guest is refused (this ends the session's usefulness); a
    # stream is always frames (a whole-file get may take the qemu driver's bulk disk instead)
    monkeypatch.setattr(env.session.channel, "max_body", 64 * 1024)
    with pytest.raises((FrameTooLarge, QuotaExceeded)):
        [chunk async for chunk in env.get_stream(path)]

    # destroy is confirmed, and idempotent
    first = await env.aclose()
    assert first.confirmed_absent, first
    second = await kit.driver.destroy(env_id)
    assert second.confirmed_absent, second
    assert (await env.aclose()) is first
    assert_gone(kit, env_id)


async def test_destroy_during_exec(kit: Kit) -> None:
    env = await kit.create()
    running = asyncio.create_task(env.exec(["sleep", "120"]))
    await asyncio.sleep(1.0)
    assert not running.done()
    report = await kit.driver.destroy(env.env_id)
    assert report.confirmed_absent, report
    with pytest.raises(EnvCrashed):
        await asyncio.wait_for(running, 30)
    assert (await env.aclose()).confirmed_absent
    assert_gone(kit, env.env_id)


async def test_guest_agent_killed_mid_request(kit: Kit) -> None:
    env = await kit.create()
    with pytest.raises(EnvCrashed):
        await asyncio.wait_for(env.exec(["sh", "-c", "kill -9 $PPID; sleep 60"]), 60)
    report = await env.aclose()
    assert report.confirmed_absent, report
    assert_gone(kit, env.env_id)


async def test_hard_deadline_kills_the_env(kit: Kit) -> None:
    deadline_s = await kit.short_deadline_s()  # no idle wait for a boot that did not happen
    started = time.monotonic()
    env = await kit.create(hard_deadline_s=deadline_s)
    with pytest.raises(EnvCrashed):
        await asyncio.wait_for(env.exec(["sleep", "600"]), deadline_s + 30)
    lived = time.monotonic() - started
    assert deadline_s - 1 < lived < deadline_s + 10, f"died after {lived:.1f}s"
    # the host-side supervisor did it, before any destroy: nothing of the env runs
    end = time.monotonic() + 5
    while time.monotonic() < end and (  # (the event loop reaps its child a moment later)
        kit.driver.alive(env.env_id) or hostproc.pids_with_marker(env.env_id)
    ):
        await asyncio.sleep(0.05)
    assert not hostproc.pids_with_marker(env.env_id)
    assert not kit.driver.alive(env.env_id)
    report = await env.aclose()
    assert report.confirmed_absent, report
    assert_gone(kit, env.env_id)


ORPHAN_SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.core.limits import ResolvedLimits

async def main():
    name, folder, run_root = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    baseline = Baseline.from_json(folder, json.loads((folder / "baseline.json").read_text()))
    drivers = {"fake": FakeDriver, "gvisor": GvisorDriver, "qemu": QemuDriver}
    driver = drivers[name](run_root=run_root)
    request = EnvRequest(new_env_id(), baseline, ResolvedLimits(), Owner("doomed"), 300.0)
    env = await driver.create(request)
    print(env.env_id, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_env_dies_with_its_controller(kit: Kit) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        ORPHAN_SCRIPT,
        kit.name,
        str(kit.baseline.path),
        str(kit.run_root),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    env_id = line.decode().strip()
    assert env_id.startswith("env-") and hostproc.pids_with_marker(env_id)
    proc.send_signal(signal.SIGKILL)  # the controller dies without any cleanup
    await proc.wait()
    end = time.monotonic() + 10
    while hostproc.pids_with_marker(env_id) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert not hostproc.pids_with_marker(env_id), "the env outlived its controller"
    assert env_id in kit.driver.list_owned()  # what is left (run folder) is found for reaping
    report = await kit.driver.destroy(env_id)
    assert report.confirmed_absent, report
    assert_gone(kit, env_id)


async def test_record_carries_driver_and_isolation(kit: Kit, tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db")
    store = LocalStore(tmp_path / "store")
    options = RunOptions(parallel=1, cleanup_window_s=30, staging_dir=tmp_path / "staging-ctl")
    try:
        ctl = Controller(kit.driver, ledger, store, options=options)
        manifest = Manifest.model_validate(
            {"episode_id": "iso", "seed": 2, "policy": {"id": "conformance"}}
        )
        result = await ctl.run([manifest], kit.baseline, run_id="conformance")
        [episode] = result.episodes
        assert episode.outcome is Outcome.COMPLETED, episode.error
        record = store.get_record("conformance", "iso")
        assert record is not None and record["reward"] == 1.0
        provenance = record["provenance"]
        assert provenance["driver"] == kit.driver.name
        assert provenance["isolation"] in ISOLATION[kit.name]
        assert provenance["accelerator"]
        for row in ledger.envs(run_id="conformance"):
            assert row.confirmed_absent_at is not None
            assert_gone(kit, row.env_id)
    finally:
        ledger.close()

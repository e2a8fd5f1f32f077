"""The home and everything under it is private to its owner (issue 15 §5).

Protects: a home (or the short runtime folder of sockets) that another user owns or can write is
refused with a typed error, never used; what the CLI and the API create is 0700/0600 (the
ledger included); raw guest output at rest lives only in 0700 staging folders, and after the
controller is SIGKILLed ``reap`` removes it and records that it did. No VM: the fake driver.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleanroom.cli import app
from cleanroom.drivers import sockets
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import ConfigError, PrivacyError
from cleanroom.host import paths, private
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.reaper import reap

from ..conftest import make_fake_baseline
from ..vmkit import request

SECRET = "s3cr3t-value-at-rest-42"
LEAKY_ENTRY = """\
import os, sys, time
for _ in range(4000):  # past the host's write buffer: the raw bytes reach the disk
    print("raw " + os.environ["TOKEN"], flush=True)
time.sleep(300)
"""
CONTROLLER = """\
import asyncio, json, sys
from pathlib import Path
import cleanroom.api as cr
from cleanroom.core.baseline_model import Baseline
from cleanroom.evidence.manifest import Manifest
cfg = json.loads(sys.argv[1])
folder = Path(cfg["baseline"])
baseline = Baseline.from_json(folder, json.loads((folder / "baseline.json").read_text()))
manifests = [Manifest.model_validate(m) for m in cfg["manifests"]]
asyncio.run(cr.arun(manifests, baseline=baseline, driver="fake", run_id="leaky",
                    secrets_from=cfg["secrets"]))
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "home"
    monkeypatch.setenv("CLEANROOM_HOME", str(folder))
    return folder


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_missing_home_is_made_private_and_a_readable_one_is_narrowed(home: Path) -> None:
    assert private.check_home() == home and mode(home) == 0o700
    home.chmod(0o755)  # an older version's home
    private.check_home()
    assert mode(home) == 0o700
    probe = home / "probe"
    probe.write_text("x")  # the umask is narrowed: new files are the owner's only
    assert mode(probe) == 0o600


@pytest.mark.parametrize("bits", [0o770, 0o707, 0o777])
def test_a_home_others_can_write_is_refused_naming_it(home: Path, bits: int) -> None:
    home.mkdir()
    home.chmod(bits)
    with pytest.raises(PrivacyError, match="writable by group or others") as info:
        private.check_home()
    assert isinstance(info.value, ConfigError) and info.value.path == home
    assert mode(home) == bits  # refused, not silently "fixed"


def test_a_home_of_another_user_or_a_link_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PrivacyError, match="owned by uid 65534"):
            private.private_dir(theirs)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PrivacyError, match="not a folder"):
        private.private_dir(link)


def test_the_cli_refuses_an_unsafe_home_with_exit_2(home: Path) -> None:
    home.mkdir()
    home.chmod(0o777)
    result = CliRunner().invoke(app, ["ps"])
    assert result.exit_code == 2, result.output
    assert str(home) in result.output and "writable by group or others" in result.output


def test_the_runtime_folder_is_short_per_home_and_unpredictable(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: the name was ``/tmp/cleanroom-<uid>-<hash of the home>``, so another user
    could make it first and fail every fake and gvisor episode of that home. Now it is random,
    kept in the (private) home, and differs between two homes of the same path."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    first = paths.runtime_dir()
    assert first.parent == paths.RUNTIME_BASE
    assert len(str(first / "env-0123456789abcdef" / "ctl.sock")) < 80
    assert paths.runtime_dir() == first  # kept
    assert (home / paths.RUNTIME_NAME).read_text().strip() == first.name
    assert hashlib.sha256(os.fsencode(home)).hexdigest()[:16] not in first.name
    monkeypatch.setenv("CLEANROOM_HOME", str(home / ("x" * 200)))
    second = paths.runtime_dir()
    assert second != first and len(str(second)) == len(str(first))
    (home / paths.RUNTIME_NAME).unlink()  # the same home made again: a new name
    monkeypatch.setenv("CLEANROOM_HOME", str(home))
    assert paths.runtime_dir() != first


@pytest.mark.parametrize("squat", ["other_owner", "open_to_all", "link"])
def test_a_runtime_folder_someone_else_made_is_left_alone_for_a_new_name(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, squat: str
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    taken = paths.runtime_dir()
    if squat == "link":
        taken.symlink_to(tmp_path)
    else:
        taken.mkdir()
        if squat == "other_owner":
            os.chown(taken, 65534, 65534)  # as if user nobody had made it first
        taken.chmod(0o777 if squat == "open_to_all" else 0o700)
    try:
        folder = sockets.make_env_dir("env-0123456789abcdef")
        assert folder.parent != taken and folder.parent == paths.runtime_dir()
        assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
        assert folder.parent.stat().st_uid == os.geteuid()
        sockets.remove_env_dir("env-0123456789abcdef")
        assert not folder.parent.exists()
    finally:
        taken.unlink() if squat == "link" else taken.rmdir()


def test_a_private_xdg_runtime_dir_is_used(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    xdg = Path(tempfile.mkdtemp(prefix="xdg-"))  # short, like /run/user/<uid>; 0700
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        assert paths.runtime_dir().parent == xdg
        folder = sockets.make_env_dir("env-0123456789abcdef")
        assert folder.parent.parent == xdg
        sockets.remove_env_dir("env-0123456789abcdef")
        assert not (home / paths.RUNTIME_NAME).exists()  # no /tmp name needed
        xdg.chmod(0o755)  # others could read it: not private, not used
        assert paths.runtime_dir().parent == paths.RUNTIME_BASE
        xdg.chmod(0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / ("r" * 80)))  # too long
        (tmp_path / ("r" * 80)).mkdir(mode=0o700)
        assert paths.runtime_dir().parent == paths.RUNTIME_BASE
    finally:
        shutil.rmtree(xdg)


async def test_the_fake_driver_works_under_a_200_character_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its agent socket used to be in the run folder: ``AF_UNIX path too long`` (issue 21)."""
    long_home = tmp_path / ("h" * (200 - len(str(tmp_path)) - 1))
    monkeypatch.setenv("CLEANROOM_HOME", str(long_home))
    baseline = make_fake_baseline(tmp_path)
    driver = FakeDriver()
    assert str(driver.run_root).startswith(str(long_home))
    env = await driver.create(request(baseline))
    try:
        assert (await env.exec(["true"])).exit_code == 0
    finally:
        report = await env.aclose()
    assert report.confirmed_absent and not sockets.env_dir(env.env_id).exists()
    assert not paths.runtime_dir().exists()  # its last env gone: nothing piles up in /tmp


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never held {text!r} within {deadline_s}s")


async def test_raw_output_at_rest_is_private_and_reaped_after_a_sigkilled_controller(
    home: Path, tmp_path: Path
) -> None:
    script = tmp_path / "leaky.py"
    script.write_text(LEAKY_ENTRY)
    baseline = make_fake_baseline(tmp_path, script)
    (tmp_path / "secrets.json").write_text(json.dumps({"TOKEN": SECRET}))
    episode = {"episode_id": "e1", "seed": 0, "policy": {"id": "p"}, "secrets": ["TOKEN"]}
    cfg = {
        "baseline": str(baseline.path),
        "manifests": [episode],
        "secrets": f"file:{tmp_path / 'secrets.json'}",
    }
    env = {**os.environ, "CLEANROOM_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, json.dumps(cfg)], env=env, stderr=subprocess.PIPE
    )
    log = home / "staging" / "leaky" / "e1" / "1" / "logs" / "stdout.log"
    try:
        _wait_for(log, SECRET, proc, 60)
        # raw (unredacted) output: only in folders that are the owner's alone
        for folder in [home, *(p for p in log.parents if home in p.parents)]:
            assert mode(folder) == 0o700, folder
        assert mode(log) == 0o600
        assert mode(home / "ledger.db") == 0o600
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    await asyncio.sleep(0)
    with Ledger(home / "ledger.db") as ledger:
        report = await reap(FakeDriver(), ledger)
        events = ledger.events("leaky", "staging_reaped")
    assert report.staging == ["leaky"] and len(events) == 1 and events[0].data["files"] >= 1
    assert not (home / "staging" / "leaky").exists()
    leftovers = subprocess.run(["grep", "-rl", SECRET, str(home)], capture_output=True, text=True)
    assert leftovers.stdout == "", leftovers.stdout


async def test_reap_leaves_the_staging_of_a_live_controller_and_of_unknown_runs(
    home: Path, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    for run in ("mine", "elsewhere"):
        (staging / run / "e" / "1").mkdir(parents=True)
    with Ledger(tmp_path / "ledger.db") as ledger:
        ledger.start_run(
            "mine", controller_id="c", baseline="b", driver="fake", parallel=1, meta={}
        )  # this process: alive
        report = await reap(FakeDriver(run_root=tmp_path / "run"), ledger, staging_root=staging)
        assert report.staging == [] and (staging / "mine").is_dir()
        assert (staging / "elsewhere").is_dir()  # not this ledger's: maybe another's, live
        ledger.finish_run("mine", "completed")
        report = await reap(FakeDriver(run_root=tmp_path / "run"), ledger, staging_root=staging)
    assert report.staging == ["mine"] and not (staging / "mine").exists()

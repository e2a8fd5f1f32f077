"""The fake driver's guest agent: the native one, compiled by the host's gcc and cached.

Protects: the fake driver runs the same agent a baseline does (HELLO says ``native``), built
once per digest of its sources (an unchanged tree is never rebuilt, an edited one is), with the
warm worker beside it; and a host without gcc gets a ``ConfigError`` that names gcc and what
needed it, before any run folder exists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cleanroom.agent import native
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import ConfigError
from cleanroom.host.hostbuild import source_key

from ..conftest import make_fake_baseline

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_agent_is_built_once_per_source_digest_with_the_worker_beside_it(home: Path) -> None:
    binary = native.host_binary()
    assert binary.parent.parent == home / "cache" / "agent"
    assert (binary.parent / "worker.py").read_bytes() == native.WORKER.read_bytes()
    built = binary.stat().st_mtime_ns
    assert native.host_binary() == binary and binary.stat().st_mtime_ns == built  # no rebuild
    sources = [native.NATIVE_DIR / name for name in native.files()]
    assert source_key(sources, native.CFLAGS) != source_key(sources[1:], native.CFLAGS)
    assert source_key(sources, native.CFLAGS) != source_key(sources, native.CFLAGS[1:])


def test_no_gcc_is_a_config_error_naming_it(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"fake driver's guest agent .*needs gcc"):
        native.host_binary()
    assert not (home / "cache" / "agent").exists() or not os.listdir(home / "cache" / "agent")


async def test_the_fake_driver_runs_the_native_agent(home: Path, tmp_path: Path) -> None:
    driver = FakeDriver(run_root=tmp_path / "run")
    request = EnvRequest(
        new_env_id(),
        make_fake_baseline(tmp_path),
        ResolvedLimits(timeout_s=30, vcpus=1, memory_mib=256),
        Owner("fake-agent"),
        hard_deadline_s=60,
    )
    env = await driver.create(request)
    try:
        assert env.hello["agent"] == "native"
        assert env.hello["agent_version"] == native.agent_version()
    finally:
        report = await env.aclose()
    assert report.confirmed_absent

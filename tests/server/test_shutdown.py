"""Ending ``cleanroom serve`` with live sandboxes: each ends ``cancelled``, durable, destroyed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import Sandbox

from cleanroom.drivers.fake import FakeDriver
from cleanroom.host import hostproc
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore, open_store

from .kit import Server, new_key, outcome, steps, stored_fake_baseline


def test_sigterm_ends_every_sandbox_cancelled_with_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: SIGTERM with two live sandboxes (one mid-command, one idle): the server exits
    0 only after both sessions ended ``cancelled`` (the ledger's outcome, the attempt's
    transcript durable in the store, naming the running command) and their envs were
    confirmed absent in the ledger and are gone from the host."""
    baseline = stored_fake_baseline(tmp_path)
    srv = Server(["--driver", "fake", "--template", f"b={baseline.digest}"], tmp_path / "log")
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        busy, idle = Sandbox.create("b"), Sandbox.create("b")
        busy.commands.run("sleep 300", background=True)
        ids = [busy.sandbox_id, idle.sandbox_id]
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    store = open_store(None)
    assert isinstance(store, LocalStore)
    for sid in ids:
        assert outcome(sid, FakeDriver(), timeout_s=5) == "cancelled"
        # cancelled is not final: no record, but the ledger row and the attempt's transcript
        assert store.get_record(f"serve-{sid}", sid) is None
        kinds = [s.get("op") for s in steps(store, f"serve-{sid}", sid, attempt=1)]
        assert ("spawn" in kinds) == (sid == busy.sandbox_id), kinds


def test_sigkill_leaves_no_env_and_the_next_start_marks_the_sandboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: a server killed with SIGKILL (no cleanup of its own) leaves no env running:
    its sandboxes' agents die with it (the parent-death path); the next ``cleanroom serve``
    reaps them before it serves: envs confirmed absent in the ledger, sessions marked."""
    baseline = stored_fake_baseline(tmp_path)
    args = ["--driver", "fake", "--template", f"b={baseline.digest}"]
    srv = Server(args, tmp_path / "log1")
    for name, value in srv.sdk_env(new_key()).items():
        monkeypatch.setenv(name, value)
    busy, idle = Sandbox.create("b"), Sandbox.create("b")
    busy.commands.run("sleep 300", background=True)
    ids = [busy.sandbox_id, idle.sandbox_id]
    with Ledger() as ledger:
        envs = [e.env_id for sid in ids for e in ledger.envs(run_id=f"serve-{sid}")]
    srv.proc.kill()
    srv.proc.wait(30)
    end = time.monotonic() + 30
    while any(hostproc.pids_with_marker(env_id) for env_id in envs):
        assert time.monotonic() < end, "an env outlived its SIGKILLed server"
        time.sleep(0.05)
    again = Server(args, tmp_path / "log2")
    try:
        for sid in ids:
            assert outcome(sid, FakeDriver(), timeout_s=10) == "infra_error"
    finally:
        assert again.stop() == 0

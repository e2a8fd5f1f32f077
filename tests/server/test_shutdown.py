"""Ending ``cleanroom serve`` with live sandboxes: each ends ``cancelled``, durable, destroyed."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2b import Sandbox

from cleanroom.drivers.fake import FakeDriver
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

"""The real ``e2b`` SDK against ``cleanroom serve`` on real QEMU microVMs (the tiny baseline)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox

from cleanroom.baseline.spec import builder_fingerprint, load_spec, spec_digest
from cleanroom.baseline.store import lookup_spec
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.server.serving import BASE_SPEC

from .kit import Server, WsRefused, new_key, outcome, via_host, wait_http, ws_echo


@pytest.mark.vm
def test_a_served_sandbox_on_a_real_vm(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: on qemu, an unmodified SDK creates a sandbox, runs commands in the guest
    (its own kernel and /), moves files (write, read, list, make_dir, rename, remove,
    exists) and watches a folder, runs and kills a background command, and kill ends the
    session ``completed`` with the VM confirmed absent in the ledger and gone from the host."""
    srv = Server(
        ["--driver", "qemu", "--template", f"tiny={tiny_baseline.digest}"], tmp_path / "serve.log"
    )
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        sbx = Sandbox.create("tiny", timeout=600)
        r = sbx.commands.run("cat /proc/sys/kernel/hostname; python3 -c 'print(6*7)'")
        assert r.stdout.splitlines()[-1] == "42"
        with pytest.raises(CommandExitException):
            sbx.commands.run("exit 4")
        watcher = sbx.files.watch_dir("/srv")
        sbx.files.write("/srv/in.txt", "in the vm")
        assert sbx.files.read("/srv/in.txt") == "in the vm"
        events = {(e.name, e.type.name) for e in watcher.get_new_events()}
        assert ("in.txt", "CREATE") in events, events
        watcher.stop()
        assert sbx.files.make_dir("/srv/d") is True
        sbx.files.rename("/srv/in.txt", "/srv/d/moved.txt")
        assert [e.name for e in sbx.files.list("/srv/d")] == ["moved.txt"]
        sbx.files.remove("/srv/d")
        assert not sbx.files.exists("/srv/d")
        h = sbx.commands.run("sleep 300", background=True)
        assert sbx.commands.kill(h.pid) is True
        sid = sbx.sandbox_id
        sbx.kill()
        assert outcome(sid, QemuDriver(), timeout_s=5) == "completed"
    finally:
        assert srv.stop() == 0, srv.log.read_text()


@pytest.mark.vm
@pytest.mark.build
def test_a_client_naming_no_template_gets_base_built_on_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: ``Sandbox.create()`` with no template gets the built-in ``base`` (Debian with
    python3, bash, git, curl, procps), which the server builds on its first use, saying so in
    its log (when this home had not built it yet), and writes no lock into the package; the
    VM runs those tools; kill ends it ``completed``."""
    spec = load_spec(BASE_SPEC)
    built_before = lookup_spec(spec_digest(spec), builder_fingerprint()) is not None
    srv = Server(["--driver", "qemu"], tmp_path / "serve.log")
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        sbx = Sandbox.create(timeout=600, request_timeout=1800)  # E2B's default: "base"
        r = sbx.commands.run(
            "git --version && python3 -c 'print(6*7)' && curl --version | head -1"
            " && ps -p 1 -o comm="
        )
        lines = r.stdout.splitlines()
        assert lines[0].startswith("git version") and lines[1] == "42", r.stdout
        assert lines[2].startswith("curl ") and lines[3], r.stdout
        sid = sbx.sandbox_id
        sbx.kill()
        assert outcome(sid, QemuDriver(), timeout_s=5) == "completed"
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    log = srv.log.read_text()
    if not built_before:  # the first use here: built, with progress
        assert "template base: digest sha256:" in log, log
    assert not (BASE_SPEC.parent / "baseline.lock").exists()


@pytest.mark.vm
def test_get_host_reaches_a_server_in_a_real_vm(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: on qemu (no NIC), ``python3 -m http.server`` started in the guest through the
    SDK answers through ``get_host(port)`` over the agent channel, a file coming back whole; a
    WebSocket echo in the guest answers text and binary; a closed guest port is a 502; without
    the traffic token the unknown sandbox's 404."""
    srv = Server(
        ["--driver", "qemu", "--template", f"tiny={tiny_baseline.digest}"], tmp_path / "serve.log"
    )
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        sbx = Sandbox.create("tiny", timeout=600)
        blob = bytes(range(256)) * 1024
        sbx.files.write("/srv/www/blob.bin", blob)
        sbx.files.write("/srv/wsecho.py", (Path(__file__).parent / "wsecho.py").read_text())
        sbx.commands.run("cd /srv/www && exec python3 -m http.server 8000", background=True)
        sbx.commands.run("exec python3 /srv/wsecho.py 8001", background=True)
        auth = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
        host = sbx.get_host(8000)
        assert wait_http(srv, host, auth, timeout_s=120).status_code == 200
        r = via_host(srv, host, path="/blob.bin", headers=auth)
        assert r.status_code == 200 and r.content == blob
        assert via_host(srv, host, path="/blob.bin").status_code == 404
        assert via_host(srv, sbx.get_host(8009), headers=auth).status_code == 502
        end = time.monotonic() + 120
        while True:
            try:
                answers = ws_echo(srv, sbx.get_host(8001), auth, ["hi", b"\x00bin"])
                break
            except WsRefused:  # not listening yet
                assert time.monotonic() < end, "no WebSocket echo in the guest within 120 s"
                time.sleep(0.2)
        assert answers == ["hi", b"\x00bin"]
        sid = sbx.sandbox_id
        sbx.kill()
        assert outcome(sid, QemuDriver(), timeout_s=5) == "completed"
    finally:
        assert srv.stop() == 0, srv.log.read_text()


@pytest.mark.vm
def test_pause_and_resume_a_served_sandbox_on_a_real_vm(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: on qemu, ``pause`` saves the guest (RAM, and with it its tmpfs disk) as a
    sealed snapshot and destroys the VM (confirmed absent); the sandbox lists ``paused``;
    ``connect`` restores it into a new VM under the same id where a file written before the
    pause is there; kill ends it, and its snapshot rows
    are all confirmed absent."""
    srv = Server(
        ["--driver", "qemu", "--template", f"tiny={tiny_baseline.digest}"], tmp_path / "serve.log"
    )
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        sbx = Sandbox.create("tiny", timeout=600)
        sid = sbx.sandbox_id
        sbx.commands.run("echo before-pause > /root/kept.txt")
        assert sbx.pause() is True
        assert Sandbox.get_info(sid).state.value == "paused"
        with Ledger() as ledger:
            assert all(e.confirmed_absent_at for e in ledger.envs(run_id=f"serve-{sid}"))
        again = Sandbox.connect(sid, timeout=600)
        assert again.commands.run("cat /root/kept.txt").stdout == "before-pause\n"
        assert again.commands.run("cat /proc/sys/kernel/random/boot_id").exit_code == 0
        again.kill()
        assert outcome(sid, QemuDriver(), timeout_s=10) == "completed"
        with Ledger() as ledger:
            assert all(s.confirmed_absent_at for s in ledger.snapshots(f"serve-{sid}"))
    finally:
        assert srv.stop() == 0, srv.log.read_text()


@pytest.mark.vm
def test_a_named_snapshot_of_a_served_sandbox_on_a_real_vm(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: on qemu, ``create_snapshot`` saves a running guest while it serves on; two
    sandboxes created from the snapshot id are two new VMs that each see the file written
    before the snapshot and not the one written after; delete confirms the files absent."""
    srv = Server(
        ["--driver", "qemu", "--template", f"tiny={tiny_baseline.digest}"], tmp_path / "serve.log"
    )
    try:
        for name, value in srv.sdk_env(new_key()).items():
            monkeypatch.setenv(name, value)
        src = Sandbox.create("tiny", timeout=600)
        src.commands.run("echo before > /root/before.txt")
        snap_id = src.create_snapshot().snapshot_id
        src.commands.run("echo after > /root/after.txt")
        assert src.commands.run("cat /root/after.txt").stdout == "after\n"
        copies = [Sandbox.create(snap_id, timeout=600) for _ in range(2)]
        for c in copies:
            assert c.commands.run("cat /root/before.txt").stdout == "before\n"
            probe = c.commands.run("test -e /root/after.txt && echo yes || echo no")
            assert probe.stdout == "no\n"
        with Ledger() as ledger:
            envs = {e.env_id for c in copies for e in ledger.envs(run_id=f"serve-{c.sandbox_id}")}
        assert len(envs) == 2
        for c in copies:
            c.kill()
            assert outcome(c.sandbox_id, QemuDriver(), timeout_s=10) == "completed"
        assert Sandbox.delete_snapshot(snap_id) is True
        with Ledger() as ledger:
            row = ledger.get_snapshot(snap_id)
            assert row is not None and row.confirmed_absent_at is not None
        src.kill()
    finally:
        assert srv.stop() == 0, srv.log.read_text()

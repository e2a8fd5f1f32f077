"""The real ``e2b`` SDK (sync and async), unmodified, against ``cleanroom serve`` (fake driver).

Every sandbox is a cleanroom session: after ``kill`` its run ``serve-<id>`` has a final
outcome and its env is confirmed absent in the ledger and gone from the host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox, SandboxQuery
from e2b.exceptions import NotFoundException, TimeoutException

from cleanroom.drivers.fake import FakeDriver

from .kit import Server, new_key, outcome


def test_commands_through_the_sync_sdk(key: str, tmp_path: Path) -> None:
    """Protects: run (stdout, stderr, exit code), envs of the sandbox and of a command, cwd,
    a non-zero exit as ``CommandExitException``, background + wait, stdin, kill, list, connect
    by pid, the command timeout as ``TimeoutException``; kill ends the session ``completed``."""
    sbx = Sandbox.create("fake", envs={"SBX_VAR": "from-sandbox"}, metadata={"who": "t1"})
    r = sbx.commands.run(
        "echo out; echo err >&2; echo $SBX_VAR $CMD_VAR; pwd",
        envs={"CMD_VAR": "from-command"},
        cwd=str(tmp_path),
    )
    assert r.exit_code == 0
    assert r.stdout == f"out\nfrom-sandbox from-command\n{tmp_path}\n"
    assert r.stderr == "err\n"

    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo nope >&2; exit 3")
    assert failed.value.exit_code == 3 and "nope" in failed.value.stderr

    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)

    h = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    assert h.wait().stdout == "got:hello\n"

    sleeper = sbx.commands.run("sleep 60", background=True)
    assert sleeper.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(sleeper.pid)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is False

    sid = sbx.sandbox_id
    sbx.kill()
    assert outcome(sid, FakeDriver()) == "completed"


def test_files_through_the_sync_sdk(key: str, tmp_path: Path) -> None:
    """Protects: write/read text and bytes (multipart and octet-stream, gzip both ways), exists,
    info, list with depth, make_dir, rename, remove; a missing file is the SDK's not-found."""
    sbx = Sandbox.create("fake")
    base = str(tmp_path)
    sbx.files.write(f"{base}/a.txt", "hello")
    assert sbx.files.read(f"{base}/a.txt") == "hello"
    blob = bytes(range(256)) * 1000
    sbx.files.write(f"{base}/b.bin", blob)
    assert bytes(sbx.files.read(f"{base}/b.bin", format="bytes")) == blob
    sbx.files.write(f"{base}/c.bin", blob, gzip=True)
    assert bytes(sbx.files.read(f"{base}/c.bin", format="bytes", gzip=True)) == blob
    assert (tmp_path / "c.bin").read_bytes() == blob  # the fake driver's guest is the host

    assert sbx.files.exists(f"{base}/a.txt") and not sbx.files.exists(f"{base}/none")
    info = sbx.files.get_info(f"{base}/b.bin")
    assert info.size == len(blob) and info.type is not None and info.type.value == "file"
    assert sbx.files.make_dir(f"{base}/d/e") is True
    assert sbx.files.make_dir(f"{base}/d/e") is False  # already there
    sbx.files.rename(f"{base}/a.txt", f"{base}/d/a2.txt")
    names = {e.name for e in sbx.files.list(base, depth=2)}
    assert {"b.bin", "c.bin", "d", "e", "a2.txt"} <= names and "a.txt" not in names
    sbx.files.remove(f"{base}/d")
    assert not (tmp_path / "d").exists()
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{base}/none")
    sid = sbx.sandbox_id
    sbx.kill()
    assert outcome(sid, FakeDriver()) == "completed"


def test_lifecycle_through_the_sync_sdk(key: str) -> None:
    """Protects: list (metadata filter), get_info, connect by id from a new client,
    set_timeout, kill -> absent from the list and not found after; a sandbox whose timeout
    passes ends ``timeout`` with its record and env confirmed absent."""
    a = Sandbox.create("fake", metadata={"group": "x"})
    b = Sandbox.create("fake", metadata={"group": "y"}, timeout=300)
    listed = Sandbox.list(query=_query({"group": "x"})).next_items()
    assert [s.sandbox_id for s in listed] == [a.sandbox_id]
    info = Sandbox.get_info(b.sandbox_id)
    assert info.metadata == {"group": "y"} and info.template_id == "fake"
    same = Sandbox.connect(a.sandbox_id)
    assert same.commands.run("echo via-connect").stdout == "via-connect\n"

    b.set_timeout(1)
    assert outcome(b.sandbox_id, FakeDriver()) == "timeout"
    with pytest.raises(NotFoundException):
        Sandbox.get_info(b.sandbox_id)

    assert Sandbox.kill(a.sandbox_id) is True
    assert outcome(a.sandbox_id, FakeDriver()) == "completed"
    assert Sandbox.kill(a.sandbox_id) is False
    assert Sandbox.list().next_items() == []


async def test_the_async_sdk(key: str, tmp_path: Path) -> None:
    """Protects: the async SDK's create / run / files / list / kill."""
    sbx = await AsyncSandbox.create("fake")
    r = await sbx.commands.run("echo async")
    assert r.stdout == "async\n"
    await sbx.files.write(f"{tmp_path}/x.txt", "async-file")
    assert await sbx.files.read(f"{tmp_path}/x.txt") == "async-file"
    assert await sbx.is_running()
    sid = sbx.sandbox_id
    await sbx.kill()
    assert outcome(sid, FakeDriver()) == "completed"


def test_metrics_endpoint_counts_sandboxes(server: Server, key: str) -> None:
    """Protects: /metrics is Prometheus text naming live and created sandboxes."""
    sbx = Sandbox.create("fake")
    text = httpx.get(server.url + "/metrics").text
    assert "cleanroom_serve_sandboxes_live" in text
    assert int(_metric(text, "cleanroom_serve_sandboxes_created_total")) >= 1
    sbx.kill()


def _metric(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return line.split()[1]
    raise AssertionError(f"{name} not in {text}")


def _query(metadata: dict[str, str]) -> SandboxQuery:
    return SandboxQuery(metadata=metadata)


def test_a_pty_through_the_sync_sdk(key: str) -> None:
    """Protects: ``sandbox.pty``: create (a login shell on a terminal of the asked size),
    send_stdin (streamed input), resize, the output as pty data, the exit code."""
    sbx = Sandbox.create("fake")
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(term.pid, b"stty size\n")
    seen = bytearray()
    for _, _, pty in term:  # the output as it comes, until the first answer
        seen.extend(pty or b"")
        if b"24 80" in seen:
            break
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((6*7)); exit\n")
    result = term.wait(on_pty=seen.extend)
    text = seen.decode(errors="replace")
    assert result.exit_code == 0
    assert "24 80" in text and "30 100" in text and "pty-42" in text, text
    sbx.kill()


def test_a_client_that_vanishes_mid_stream_does_not_end_its_sandbox(
    key: str, tmp_path: Path
) -> None:
    """Protects: E2B's semantics: a client killed while streaming a command's output leaves
    the sandbox and the command running; another client connects by id, finds the command
    in the list, reattaches by pid, and ends it."""
    script = tmp_path / "client.py"
    script.write_text(
        "from e2b import Sandbox\n"
        "sbx = Sandbox.create('fake')\n"
        "h = sbx.commands.run('while true; do echo tick; sleep 0.1; done', background=True)\n"
        "print(sbx.sandbox_id, h.pid, flush=True)\n"
        "h.wait(on_stdout=lambda _: None)\n"
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    sid, pid = child.stdout.readline().split()
    child.kill()
    child.wait(30)
    sbx = Sandbox.connect(sid)
    assert int(pid) in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(int(pid))
    ticks = bytearray()
    for out, _, _ in again:
        ticks.extend((out or "").encode())
        if ticks.count(b"tick") >= 2:
            break
    assert sbx.commands.kill(int(pid)) is True
    sbx.kill()
    assert outcome(sid, FakeDriver()) == "completed"


def test_a_guest_that_kills_its_agent_fails_only_its_sandbox(key: str) -> None:
    """Protects: a command that kills the guest agent mid-command fails that call (an SDK
    exception, not a hang) and ends that sandbox ``env_crashed`` with its env confirmed
    absent; a second sandbox of the same key keeps working, and the server too."""
    victim, bystander = Sandbox.create("fake"), Sandbox.create("fake")
    with pytest.raises(Exception) as failed:  # the SDK's error type depends on the moment
        victim.commands.run("echo going; kill -9 $PPID; sleep 30", timeout=60)
    assert not isinstance(failed.value, TimeoutException), failed.value
    assert outcome(victim.sandbox_id, FakeDriver()) == "env_crashed"
    with pytest.raises(NotFoundException):
        Sandbox.get_info(victim.sandbox_id)
    assert bystander.commands.run("echo fine").stdout == "fine\n"
    bystander.kill()


def test_logs_are_the_sessions_transcript(server: Server, key: str) -> None:
    """Protects: GET /sandboxes/{id}/logs (and /v2) answer the sandbox's transcript steps as
    E2B log entries the SDK's own models parse; another key gets 404."""
    from e2b.api.client.models import SandboxLogs, SandboxLogsV2Response

    sbx = Sandbox.create("fake")
    sbx.commands.run("echo logged")
    url = f"{server.url}/sandboxes/{sbx.sandbox_id}/logs"
    got = SandboxLogs.from_dict(httpx.get(url, headers={"X-API-Key": key}).json())
    assert any(
        '"exit_code": 0' in e.message and "echo logged" in e.message for e in got.log_entries
    )
    v2 = httpx.get(f"{server.url}/v2/sandboxes/{sbx.sandbox_id}/logs", headers={"X-API-Key": key})
    assert SandboxLogsV2Response.from_dict(v2.json()).logs
    other = httpx.get(url, headers={"X-API-Key": new_key("other")})
    assert other.status_code == 404
    sbx.kill()


def test_an_unknown_template_is_e2bs_not_found(server: Server, key: str) -> None:
    """Protects: a template no ``--template`` names answers 404 (E2B's not-found), not 500."""
    r = httpx.post(
        server.url + "/sandboxes",
        headers={"X-API-Key": key},
        json={"templateID": "no-such-template"},
    )
    assert r.status_code == 404 and "not found" in r.json()["message"]
    with pytest.raises(Exception, match="not found"):
        Sandbox.create("no-such-template")

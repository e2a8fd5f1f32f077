"""The native guest agent (``agent/native``) as a host process, driven by the real host side
(``AgentConnection``) over a unix socket, as the fake driver drives it.

Each test protects one thing the host relies on whichever agent runs: the HELLO fields, PING,
EXEC's streams, exit codes and deadline, writes and reads in chunks (the first protocol's
unnumbered EXEC, PUT and GET refused), and a command episode's
artifacts, result record, secrets and manifest. Skips without gcc (the builder needs it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.agent.nativekit import connected

from cleanroom.agent import native, protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import ProtocolError

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.fixture(scope="module")
def agent_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native") / native.BINARY
    subprocess.run(native.gcc_argv(out), cwd=native.NATIVE_DIR, check=True)
    return out


def drive(binary: Path, root: Path, body: Any, extra_env: dict[str, str] | None = None) -> Any:
    async def main() -> Any:
        async with connected(binary, root, extra_env) as session:
            return await body(session)

    return asyncio.run(main())


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def test_the_binary_is_the_same_bytes_wherever_it_is_built(
    agent_binary: Path, tmp_path: Path
) -> None:
    """Reproducible: fixed flags, relative sources, no timestamps (baseline digests hold)."""
    again = tmp_path / "elsewhere" / native.BINARY
    again.parent.mkdir()
    subprocess.run(native.gcc_argv(again), cwd=native.NATIVE_DIR, check=True)
    assert again.read_bytes() == agent_binary.read_bytes()


def test_hello_names_a_native_agent_the_snapshot_driver_accepts(
    agent_binary: Path, root: Path
) -> None:
    """The qemu template driver needs agent_version >= 0.2; episodes record kernel and boot."""

    async def body(session: AgentConnection) -> dict[str, Any]:
        await session.ping()
        return session.hello

    hello = drive(agent_binary, root, body)
    assert hello["agent"] == "native" and hello["protocol"] == protocol.PROTOCOL_VERSION
    assert hello["agent_version"] == native.agent_version()
    assert isinstance(hello["boot_time_s"], float) and hello["kernel"]


def test_exec_relays_both_streams_the_code_and_kills_the_group_at_its_deadline(
    agent_binary: Path, root: Path
) -> None:
    """The EXEC contract: stdout/stderr apart, exit code, a timeout that kills grandchildren."""

    async def body(session: AgentConnection) -> Any:
        first = await session.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10)
        slow = await session.exec(["sh", "-c", "sleep 30 & sleep 30"], timeout_s=0.5)
        missing = await session.exec(["no-such-program-here"], timeout_s=5)
        env = await session.exec(["sh", "-c", "echo $FOO:$HOME"], env={"FOO": "bar"}, cwd="/tmp")
        return first, slow, missing, env

    first, slow, missing, env = drive(agent_binary, root, body)
    assert (first.stdout, first.stderr, first.exit_code) == (b"out\n", b"err\n", 3)
    assert slow.timed_out and slow.signal == 9 and slow.duration_s < 5
    assert missing.exit_code == 127 and b"cannot start" in missing.stderr
    assert env.stdout == b"bar:/root\n"


def test_put_in_chunks_then_get_returns_the_same_bytes(agent_binary: Path, root: Path) -> None:
    """A write of several chunks replaces what was there (a shorter file is not left with the
    old tail), and a read returns the same bytes, both as numbered streams."""
    data = os.urandom(protocol.CHUNK * 2 + 17)
    target = root / "put" / "deep" / "file.bin"

    async def body(session: AgentConnection) -> tuple[bytes, bytes]:
        await session.put(str(target), b"old content that must go" * 50_000)
        await session.put(str(target), data, 0o600)
        again = await session.get(str(target))
        await session.put(str(target), b"short")
        return again, await session.get(str(target))

    whole, short = drive(agent_binary, root, body)
    assert whole == data and short == b"short"
    assert target.read_bytes() == b"short" and target.stat().st_mode & 0o777 == 0o644


def test_the_first_protocols_unnumbered_requests_are_refused(
    agent_binary: Path, root: Path
) -> None:
    """The retired EXEC without an id, PUT (4) and GET (5): each answered by an ERROR naming
    the frame, nothing written, and the agent serves on."""
    target = root / "guest-put"

    async def body(session: AgentConnection) -> list[str]:
        errors = []
        for kind, header in (
            (protocol.Kind.EXEC, {"argv": ["true"]}),
            (4, {"path": str(target), "mode": 0o644, "offset": 0}),
            (5, {"path": "/etc/hostname"}),
        ):
            async with session._one_at_a_time():
                await session._send(kind, header, b"x")
                with pytest.raises(ProtocolError) as caught:
                    await session._read()
                errors.append(str(caught.value))
        assert (await session.exec(["true"])).ok
        return errors

    errors = drive(agent_binary, root, body)
    assert [e.rsplit(" ", 1)[-1] for e in errors] == ["3", "4", "5"], errors
    assert all("unexpected frame" in e for e in errors), errors
    assert not target.exists()


def test_a_command_episode_returns_artifacts_result_and_logs_and_drops_its_secrets(
    agent_binary: Path, root: Path
) -> None:
    """RUN: manifest written, secret as a file and env only while it runs, artifacts (never a
    symlink), result.json, both logs, the exit code."""
    guest = root / "guest" / "run" / "cleanroom"
    script = (
        'cat "$CLEANROOM_DIR/secrets/token" > "$CLEANROOM_DIR/out/seen"; '
        'mkdir -p "$CLEANROOM_DIR/out/sub"; echo nested > "$CLEANROOM_DIR/out/sub/b.txt"; '
        'ln -s /etc/passwd "$CLEANROOM_DIR/out/link"; '
        'cp "$CLEANROOM_DIR/manifest.json" "$CLEANROOM_DIR/out/manifest"; '
        'echo \'{"reward": 1.5}\' > "$CLEANROOM_DIR/result.json"; echo hello; echo oops >&2; exit 4'
    )
    request = {
        "manifest": {"episode": "e1", "seed": 7},
        "entrypoint": ["sh", "-c", script],
        "env": {"A": "1"},
        "timeout_s": 20,
        "secret_files": {"token": "s3cret"},
    }

    async def body(session: AgentConnection) -> Any:
        return await session.run_episode(request, root / "staging", quota_bytes=1 << 24)

    output = drive(agent_binary, root, body)
    assert output.exit.exit_code == 4
    assert json.loads(output.result_raw) == {"reward": 1.5}
    names = {a.name: a.path.read_bytes() for a in output.artifacts}
    assert names["seen"] == b"s3cret" and names["sub/b.txt"] == b"nested\n"
    assert "link" not in names
    assert json.loads(names["manifest"]) == request["manifest"]
    assert output.stdout_path.read_bytes() == b"hello\n"
    assert output.stderr_path.read_bytes() == b"oops\n"
    assert not (guest / "secrets" / "token").exists()


def test_an_episode_past_its_deadline_is_killed_and_still_reports(
    agent_binary: Path, root: Path
) -> None:
    """A timeout is an EXIT with timed_out, then the (absent) result and DONE."""
    request = {"manifest": {}, "entrypoint": ["sleep", "30"], "timeout_s": 0.5}

    async def body(session: AgentConnection) -> Any:
        return await session.run_episode(request, root / "staging", quota_bytes=1 << 20)

    output = drive(agent_binary, root, body)
    assert output.exit.timed_out and output.result_raw is None


def test_a_bad_frame_ends_the_agent_instead_of_desynchronizing(
    agent_binary: Path, root: Path
) -> None:
    """A stream that is not frames ends the agent (the VM powers off): nothing is guessed."""

    async def body(session: AgentConnection) -> bytes:
        session._writer.write(b"XX" + b"\0" * 9)
        await session._writer.drain()
        return await asyncio.wait_for(session._reader.read(), 10)

    assert drive(agent_binary, root, body) == b""


def test_the_c_constants_are_the_protocols() -> None:
    """frame.h and agent.c restate protocol.py's kinds and limits: they must not drift. The
    native agent reads the multiplexed kinds too (mux.c), up to WARM_UP, and the gym's (40-46),
    which it relays to the gym process (gym.c)."""
    import re

    text = "".join((native.NATIVE_DIR / n).read_text() for n in ("frame.h", "agent.c", "mux.c"))
    found = {
        name: eval(value)  # simple integer expressions such as 256 * 1024
        for name, value in re.findall(r"^\s*(K_[A-Z_]+|[A-Z_]+) = ([0-9 *]+),", text, re.M)
    }
    theirs = {name: v for name, v in vars(protocol.Kind).items() if isinstance(v, int)}
    for name, value in theirs.items():
        assert found[f"K_{name}"] == value, name
    assert found["KIND_MAX"] == protocol.Kind.CONNECT == max(v for v in theirs.values() if v < 40)
    for name in ("MAX_HEADER", "CHUNK", "RESULT_MAX_BYTES", "MAX_NAME", "MAX_NAME_PARTS"):
        assert found[name] == getattr(protocol, name), name
    assert found["MAX_BODY"] == protocol.DEFAULT_MAX_BODY
    assert found["WINDOW"] == protocol.WINDOW


def test_a_result_larger_than_one_chunk_arrives_whole(agent_binary: Path, root: Path) -> None:
    """result.json goes in RESULT chunks (protocol.CHUNK each): 300 KB is two frames, joined
    by the host in order."""
    script = (
        'f="$CLEANROOM_DIR/result.json"; printf \'{"reward": 1, "info": {"pad": "\' > "$f"; '
        'head -c 300000 /dev/zero | tr \'\\0\' x >> "$f"; printf \'"}}\' >> "$f"'
    )
    request = {"manifest": {}, "entrypoint": ["sh", "-c", script], "timeout_s": 20}

    async def body(session: AgentConnection) -> Any:
        return await session.run_episode(request, root / "staging", quota_bytes=1 << 24)

    output = drive(agent_binary, root, body)
    assert output.result_raw is not None and len(output.result_raw) > protocol.CHUNK
    assert json.loads(output.result_raw)["info"]["pad"] == "x" * 300000


def test_orphans_left_by_a_request_are_reaped_outside_a_vm(agent_binary: Path, root: Path) -> None:
    """As a subreaper the agent adopts what a request leaves running; once it exits it must
    not stay a zombie under the agent."""

    async def body(session: AgentConnection) -> Any:
        started = await session.exec(["sh", "-c", "sleep 0.2 & echo $!"], timeout_s=10)
        orphan = started.stdout.strip()
        stat = Path(f"/proc/{orphan.decode()}/stat")
        for _ in range(1000):  # until it has exited (a zombie, or reaped already); not a timer
            with contextlib.suppress(FileNotFoundError):
                if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    await asyncio.sleep(0.01)
                    continue
            break
        await session.exec(["true"], timeout_s=10)  # the next request reaps it
        ps = await session.exec(["sh", "-c", "cat /proc/$PPID/task/*/children"], timeout_s=10)
        return orphan, ps.stdout.split()

    orphan, children = drive(agent_binary, root, body)
    assert orphan.isdigit() and orphan not in children
    assert len(children) == 1  # only the shell asking


def test_the_c_network_layout_is_guestnets() -> None:
    """net.c restates guestnet.py's fixed layout (the host's proxy and DNS forwards expect it)."""
    import re

    from cleanroom.agent import guestnet

    text = (native.NATIVE_DIR / "net.c").read_text()
    found = dict(re.findall(r'^#define ([A-Z_]+) "([^"]*)"', text, re.M))
    assert found["IFACE"] == guestnet.IFACE and found["NETMASK"] == guestnet.NETMASK
    assert found["GUEST_ADDR"] == guestnet.GUEST_ADDR and found["GATEWAY"] == guestnet.GATEWAY
    assert found["DNS_ADDR"] == guestnet.DNS_ADDR
    proxy = guestnet.proxy_env()
    assert found["PROXY_URL"] == proxy["HTTP_PROXY"] and found["NO_PROXY"] == proxy["NO_PROXY"]
    assert sorted(re.findall(r'\{"([A-Za-z_]+)", (?:PROXY_URL|NO_PROXY)\}', text)) == sorted(proxy)
    assert "options use-vc timeout:5 attempts:2" in text


def test_artifact_names_go_to_the_host_to_judge_as_the_python_agent_sends_them(
    agent_binary: Path, root: Path
) -> None:
    """A name that is not UTF-8 arrives as Python's os.fsdecode writes it (a lone surrogate)
    and a long one whole: the host refuses both by name (the agent used to drop them, so the
    episode looked clean)."""
    from cleanroom.errors import ProtocolError, UnsafePath

    request = {"manifest": {}, "entrypoint": ["true"], "timeout_s": 20}

    async def body(session: AgentConnection) -> Any:
        return await session.run_episode(request, root / "staging", quota_bytes=1 << 20)

    outcomes = []
    for name in (b"x\xffy", b"/".join([b"n" * 250] * 5)):  # 1254 bytes: over MAX_NAME
        target = os.fsencode(root) + b"/guest/run/cleanroom/out/" + name
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(b"bytes")
        with pytest.raises((UnsafePath, ProtocolError)) as info:
            drive(agent_binary, root, body)
        outcomes.append(str(info.value))
        os.unlink(target)
    assert "surrogate" in outcomes[0]
    assert str(protocol.MAX_NAME) in outcomes[1] or "long" in outcomes[1], outcomes[1]

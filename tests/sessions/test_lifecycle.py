"""Every way a session ends, on the fake driver (the real agent as a host process): the
transcript durable, the env confirmed absent, exactly one outcome, the right error raised.
The same endings on real VMs: ``test_conformance.py``."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import inspect
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cleanroom as cr
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import SessionClosed, SessionTimeout
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import AsyncSession, Session, session
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..conftest import make_fake_baseline
from .kit import ended, folder, root, steps

OPTIONS = RunOptions(cleanup_window_s=10)
SECRET = "hf_s3ss10nT0ken/Value"


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[FakeDriver, Ledger, LocalStore]]:
    with Ledger(tmp_path / "ledger.db") as ledger:
        yield FakeDriver(run_root=tmp_path / "run"), ledger, LocalStore(tmp_path / "store")


def _open(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore], run_id: str, **kw: Any
) -> Any:
    driver, ledger, store = parts
    return session(
        make_fake_baseline(tmp_path),
        driver=driver,
        ledger=ledger,
        store=store,
        run_id=run_id,
        options=OPTIONS,
        **kw,
    )


async def test_commands_files_and_artifacts_in_the_transcript(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: commands.run (string through sh, list as argv, exit code as data), files
    write/read/exists/list/upload_dir/download_dir, and finish(artifacts=...) fetching the named
    guest files into the record; every step in the transcript, output as a log span whose
    sha256 matches the stored commands.log."""
    driver, ledger, store = parts
    local = tmp_path / "local"
    (local / "pkg").mkdir(parents=True)
    (local / "pkg" / "a.txt").write_bytes(b"alpha")
    (local / "b.txt").write_bytes(b"beta")
    async with _open(tmp_path, parts, "c1") as sb:
        top = root(driver, sb)
        r = await sb.commands.run("echo hi; echo err >&2; exit 4")
        assert (r.exit_code, r.stdout, r.stderr, r.ok) == (4, "hi\n", "err\n", False)
        assert (await sb.commands.run(["echo", "a b"])).stdout == "a b\n"
        await sb.files.write(f"{top}/tmp/x/note.txt", "text")
        assert await sb.files.read(f"{top}/tmp/x/note.txt") == b"text"
        assert await sb.files.exists(f"{top}/tmp/x/note.txt")
        assert not await sb.files.exists(f"{top}/tmp/x/none")
        assert await sb.files.upload_dir(local, f"{top}/tmp/up") == 2
        assert await sb.files.list(f"{top}/tmp/up") == ["b.txt", "pkg"]
        assert await sb.files.download_dir(f"{top}/tmp/up", tmp_path / "down") == 2
        assert (tmp_path / "down" / "pkg" / "a.txt").read_bytes() == b"alpha"
        sb.finish(reward=2.0, info={"k": 1}, artifacts=[f"{top}/tmp/x/note.txt"])
    assert ended(driver, ledger, store, "c1") == "completed"
    record = store.get_record("c1", "session")
    assert record is not None and record["reward"] == 2.0
    [artifact] = record["artifacts"]
    assert artifact["name"].endswith("tmp/x/note.txt")
    assert artifact["sha256"] == hashlib.sha256(b"text").hexdigest()
    log = evidence(folder(store, "c1"), "logs", "commands.log").read_bytes()
    first = steps(store, "c1")[0]
    span = first["stderr_log"]
    assert log[span["offset"] : span["offset"] + span["size"]] == b"err\n"
    assert hashlib.sha256(b"err\n").hexdigest() == span["sha256"]
    assert {s["op"] for s in steps(store, "c1")} == {"exec", "put", "get", "finish", "artifact"}


async def test_idle_timeout_ends_the_session_as_timeout(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: idle_timeout_s ends a session nobody calls: SessionTimeout raised (naming
    idle_timeout_s), outcome timeout with a durable record and transcript, env gone; a call
    that runs longer than the idle limit does not count as idle."""
    driver, ledger, store = parts
    with pytest.raises(SessionTimeout) as caught:
        async with _open(tmp_path, parts, "t1", idle_timeout_s=0.5) as sb:
            assert (await sb.commands.run("sleep 1; echo done")).stdout == "done\n"
            await asyncio.sleep(5)
    assert caught.value.limit == "idle_timeout_s"
    assert ended(driver, ledger, store, "t1") == "timeout"
    record = store.get_record("t1", "session")
    assert record is not None and "idle_timeout_s" in record["error"]["message"]
    assert [s["op"] for s in steps(store, "t1")] == ["exec", "expired"]


async def test_timeout_cancels_a_running_command(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: timeout_s ends the session even while a command runs (it is cancelled);
    the command's step says it was cut short; a later call is refused (SessionClosed)."""
    driver, ledger, store = parts
    with pytest.raises(SessionTimeout) as caught:
        async with _open(tmp_path, parts, "t2", timeout_s=1) as sb:
            await sb.commands.run("sleep 20")
    assert caught.value.limit == "timeout_s"
    assert ended(driver, ledger, store, "t2") == "timeout"
    expired, cut = steps(store, "t2")
    assert expired["op"] == "expired" and expired["limit"] == "timeout_s"
    assert cut["op"] == "exec" and "CancelledError" in cut["error"]
    with pytest.raises(SessionClosed):
        await sb.commands.run("true")


async def test_cancellation_ends_the_session_cancelled(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: a cancelled caller's session ends cancelled, its transcript kept with the
    attempt and the env confirmed absent before CancelledError reaches the caller."""
    driver, ledger, store = parts
    opened = asyncio.Event()

    async def body() -> None:
        async with _open(tmp_path, parts, "k1") as sb:
            await sb.commands.run("true")
            opened.set()
            await sb.commands.run("sleep 30")

    task = asyncio.create_task(body())
    await opened.wait()
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended(driver, ledger, store, "k1") == "cancelled"
    assert [s["op"] for s in steps(store, "k1", attempt=1)][:1] == ["exec"]


async def test_secrets_reach_commands_and_never_the_transcript(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: secrets=[names] are resolved like a manifest's, given to every command, and
    redacted in the transcript, the command log and the record (no stored byte holds one)."""
    monkeypatch.setenv("SES_TOKEN", SECRET)
    driver, ledger, store = parts
    async with _open(tmp_path, parts, "s1", secrets=["SES_TOKEN"]) as sb:
        r = await sb.commands.run('echo "$SES_TOKEN"; echo "$SES_TOKEN" >&2')
        assert r.stdout == SECRET + "\n"  # the caller sees the real output
        await sb.commands.run(["echo", SECRET])  # in argv too
        sb.finish(reward=1.0, info={"said": SECRET})
    assert ended(driver, ledger, store, "s1") == "completed"
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            assert b"s3ss10n" not in path.read_bytes(), path
    assert "[REDACTED:SES_TOKEN]" in steps(store, "s1")[0]["stdout"]


async def test_the_session_api_from_the_top_level_module(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: ``cr.session`` is a plain function, still after the package
    ``cleanroom.sessions`` is imported (a package named like the function replaced it on the
    ``cleanroom`` module: a module-class hack made that module callable), and ``cr.Session`` is
    the blocking twin."""
    import cleanroom.sessions

    assert inspect.isfunction(cr.session)
    assert cr.session is cleanroom.sessions.session
    driver, ledger, store = parts
    async with cr.session(
        make_fake_baseline(tmp_path), driver=driver, ledger=ledger, store=store, run_id="m1"
    ) as sb:
        assert isinstance(sb, AsyncSession)
        sb.finish(reward=0.0)
    assert cr.Session is Session
    assert ended(driver, ledger, store, "m1") == "completed"


def test_a_sync_session_shared_by_threads(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: ``with cr.Session(...)`` blocks per call, works from several threads at once
    (each call marshalled onto the session's loop), and destroys the env on leaving ``with``;
    an exception in the block ends it like the async one (raised again, env gone)."""
    driver, ledger, store = parts
    baseline = make_fake_baseline(tmp_path)
    with Session(baseline, driver=driver, ledger=ledger, store=store, run_id="y1") as sb:
        outs: list[str] = []
        threads = [
            threading.Thread(target=lambda i=i: outs.append(sb.commands.run(f"echo {i}").stdout))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outs) == [f"{i}\n" for i in range(4)]
        sb.finish(reward=1.0)
    assert ended(driver, ledger, store, "y1") == "completed"
    assert len(steps(store, "y1")) == 5
    y2 = Session(baseline, driver=driver, ledger=ledger, store=store, run_id="y2")
    with pytest.raises(ZeroDivisionError), y2 as sb:
        sb.commands.run("true")
        _ = 1 / 0
    assert ended(driver, ledger, store, "y2") == "infra_error"


def test_a_dropped_sync_session_is_destroyed_with_a_warning(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: a Session garbage-collected while open is destroyed (outcome cancelled, env
    confirmed absent) and says so with a ResourceWarning."""
    driver, ledger, store = parts
    sb = Session(
        make_fake_baseline(tmp_path), driver=driver, ledger=ledger, store=store, run_id="g1"
    ).open()
    sb.commands.run("true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del sb
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert ended(driver, ledger, store, "g1") == "cancelled"


LEFT_OPEN = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.conftest import make_fake_baseline
import cleanroom as cr
from cleanroom.drivers.fake import FakeDriver
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
tmp = Path(sys.argv[1])
sb = cr.Session(make_fake_baseline(tmp / "b"), driver=FakeDriver(run_root=tmp / "run"),
                ledger=Ledger(tmp / "ledger.db"), store=LocalStore(tmp / "store"), run_id="x1")
sb.open()
print(sb.commands.run("echo up").stdout, flush=True)
"""


def test_a_session_left_open_at_exit_is_destroyed(tmp_path: Path) -> None:
    """Protects: a process that ends with a session still open (no close, no ``with``)
    destroys its env at exit, warns, and the ledger says cancelled, env confirmed absent."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONWARNINGS": "always::ResourceWarning"}
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_OPEN, str(tmp_path), str(repo)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "up" in proc.stdout and "ResourceWarning" in proc.stderr
    with Ledger(tmp_path / "ledger.db") as ledger:
        driver = FakeDriver(run_root=tmp_path / "run")
        assert ended(driver, ledger, LocalStore(tmp_path / "store"), "x1") == "cancelled"


async def test_bad_arguments_are_typed_errors_naming_the_place(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    """Protects: a caller's bad input is a clear CleanroomError naming what was wrong (an
    artifact that escapes, an empty command, a local folder that is none, a missing guest file
    as GuestFileNotFound), and none of them ends the session."""
    from cleanroom.errors import GuestFileNotFound, ManifestError, SessionPathError

    driver, ledger, store = parts
    async with _open(tmp_path, parts, "e1") as sb:
        with pytest.raises(ManifestError, match="artifact"):
            sb.finish(reward=0.0, artifacts=["/repo/../../etc/passwd"])
        with pytest.raises(ManifestError, match="empty command"):
            await sb.commands.run("  ")
        with pytest.raises(SessionPathError, match="not a folder"):
            await sb.files.upload_dir(tmp_path / "none", "/tmp/x")
        with pytest.raises(GuestFileNotFound):
            await sb.files.read(f"{root(driver, sb)}/tmp/none-such")
        sb.finish(reward=1.0)
    assert ended(driver, ledger, store, "e1") == "completed"

"""The session API on every driver (fake, qemu, gvisor: one suite), and the endings that need a
real VM: a hostile guest mid-session, SIGKILL of the owning process, 8 sessions at once."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import RunFolderDriver
from cleanroom.drivers.fake import FakeDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import CleanroomError, ProtocolError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.lifecycle.reaper import reap
from cleanroom.sessions import session
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..conftest import TINY_SPEC, make_fake_baseline
from .kit import ended, folder, root, steps

OPTIONS = RunOptions(cleanup_window_s=20)
REPO = Path(__file__).resolve().parents[2]


class Rig:
    def __init__(self, driver: RunFolderDriver, baseline: Baseline, tmp: Path) -> None:
        self.driver, self.baseline = driver, baseline
        self.ledger, self.store = Ledger(tmp / "ledger.db"), LocalStore(tmp / "store")

    def open(self, run_id: str, **kw: Any) -> Any:
        return session(
            self.baseline,
            driver=self.driver,
            ledger=self.ledger,
            store=self.store,
            run_id=run_id,
            options=OPTIONS,
            **kw,
        )


def _rig(request: pytest.FixtureRequest, tmp_path: Path) -> Rig:
    if request.param == "fake":
        return Rig(FakeDriver(run_root=tmp_path / "run"), make_fake_baseline(tmp_path), tmp_path)
    tiny = request.getfixturevalue("tiny_baseline")
    if request.param == "qemu":
        return Rig(QemuDriver(), tiny, tmp_path)
    request.getfixturevalue("gvisor_usable")
    return Rig(GvisorDriver(run_root=tmp_path / "run"), tiny, tmp_path)


QEMU = pytest.param("qemu", marks=pytest.mark.vm)


@pytest.fixture(params=["fake", QEMU, "gvisor"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    made = _rig(request, tmp_path)
    yield made
    made.ledger.close()


@pytest.fixture(params=["fake", QEMU])  # gVisor has no pidfd_getfd: no command takes a channel
def hostile_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    made = _rig(request, tmp_path)
    yield made
    made.ledger.close()


async def test_the_session_api(rig: Rig, tmp_path: Path) -> None:
    """Protects (every driver): commands (a string through sh, argv, cwd, env, stdin-less exit
    codes as data, a per-command timeout), files of any size (2 MiB: several chunks), exists,
    list, upload_dir/download_dir, finish with an artifact; then the record, the transcript and
    the command log durable and the env confirmed absent."""
    local = tmp_path / "local"
    (local / "d").mkdir(parents=True)
    (local / "d" / "one.txt").write_text("one")
    big = os.urandom(2 * 1024 * 1024)
    async with rig.open("api") as sb:
        top = root(rig.driver, sb)
        await sb.files.write(f"{top}/tmp/w/big.bin", big)
        assert await sb.files.read(f"{top}/tmp/w/big.bin") == big
        r = await sb.commands.run(
            "pwd; echo $GREETING; exit 7", cwd=f"{top}/tmp/w", env={"GREETING": "hey"}
        )
        assert (r.exit_code, r.stdout.split()) == (7, [f"{top}/tmp/w", "hey"])
        assert (await sb.commands.run(["sha256sum", f"{top}/tmp/w/big.bin"])).stdout.startswith(
            hashlib.sha256(big).hexdigest()
        )
        slow = await sb.commands.run("sleep 30", timeout=1)
        assert slow.timed_out and not slow.ok
        with pytest.raises(CleanroomError):
            slow.check()
        assert await sb.files.upload_dir(local, f"{top}/tmp/up") == 1
        assert await sb.files.list(f"{top}/tmp/up") == ["d"]
        assert await sb.files.exists(f"{top}/tmp/up/d/one.txt")
        assert await sb.files.download_dir(f"{top}/tmp/up", tmp_path / "back") == 1
        assert (tmp_path / "back" / "d" / "one.txt").read_text() == "one"
        await sb.commands.run(f"echo patched > {top}/tmp/w/patch.diff")
        sb.finish(
            reward=1.0, info={"driver": rig.driver.name}, artifacts=[f"{top}/tmp/w/patch.diff"]
        )
    assert ended(rig.driver, rig.ledger, rig.store, "api") == "completed"
    record = rig.store.get_record("api", "session")
    assert record is not None and [a["size"] for a in record["artifacts"]] == [8]
    assert {log["name"] for log in record["logs"]} >= {"transcript.jsonl", "commands.log"}
    assert evidence(folder(rig.store, "api"), "logs", "commands.log").stat().st_size > 0
    assert [s["op"] for s in steps(rig.store, "api")][-2:] == ["finish", "artifact"]


async def test_streaming_stdin_and_background_commands(rig: Rig) -> None:
    """Protects (every driver): output reaches ``on_stdout`` while the command runs (before it
    ends), ``stdin`` feeds a command, a background command takes input and is killed, two
    commands run at once in one env; each ends as a transcript step (background ones too)."""
    async with rig.open("stream") as sb:
        chunks: list[bytes] = []
        seen_before_end = asyncio.Event()

        def got(chunk: bytes) -> None:
            chunks.append(chunk)
            if b"first" in b"".join(chunks):
                seen_before_end.set()

        run = asyncio.create_task(
            sb.commands.run("echo first; sleep 2; echo second", on_stdout=got)
        )
        await asyncio.wait_for(seen_before_end.wait(), 10)
        assert not run.done()  # streamed, not delivered at the end
        assert (await run).stdout == "first\nsecond\n"
        assert (await sb.commands.run("cat", stdin=b"fed")).stdout == "fed"
        h = await sb.commands.run("cat; sleep 60", background=True)
        await h.send_stdin(b"bg input")
        await h.close_stdin()
        both = await asyncio.gather(
            sb.commands.run("sleep 1; echo a"), sb.commands.run("sleep 1; echo b")
        )
        assert [r.stdout for r in both] == ["a\n", "b\n"]
        await h.kill()
        done = await h.wait()
        assert done.stdout == "bg input" and not done.ok
        sb.finish(reward=1.0)
    assert ended(rig.driver, rig.ledger, rig.store, "stream") == "completed"
    ops = [(s["op"], s.get("background")) for s in steps(rig.store, "stream")]
    assert ("spawn", None) in ops and ("exec", True) in ops


async def test_an_idle_session_in_a_real_vm_ends_timeout(rig: Rig) -> None:
    """Protects (every driver): idle_timeout_s ends the session as ``timeout``, the VM is
    destroyed and confirmed absent before SessionTimeout reaches the caller."""
    from cleanroom.errors import SessionTimeout

    with pytest.raises(SessionTimeout):
        async with rig.open("idle", idle_timeout_s=1) as sb:
            await sb.commands.run("true")
            await asyncio.sleep(30)
    assert ended(rig.driver, rig.ledger, rig.store, "idle") == "timeout"


GARBAGE = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
pid = os.getppid()
while pid > 1:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("/dev/vport", "socket:")):
            pidfd = libc.syscall(434, pid, 0)
            stolen = libc.syscall(438, pidfd, int(fd), 0)
            os.write(stolen, b"XXnot a frame at all" * 64)
            time.sleep(3)
            sys.exit(0)
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
sys.exit(9)
"""


async def test_a_hostile_guest_fails_only_its_own_session(hostile_rig: Rig) -> None:
    """Protects (every driver): a guest that answers garbage mid-session ends that session
    only: ProtocolError to its caller, outcome episode_error with the transcript durable, its
    env confirmed absent; a session running beside it completes."""
    rig = hostile_rig

    async def hostile() -> None:
        async with rig.open("bad") as sb:
            top = root(rig.driver, sb)
            await sb.files.write(f"{top}/tmp/g.py", GARBAGE)
            await sb.commands.run(["python3", f"{top}/tmp/g.py"])

    async def calm() -> None:
        async with rig.open("good") as sb:
            for _ in range(3):
                (await sb.commands.run("echo ok")).check()
                await asyncio.sleep(0.5)
            sb.finish(reward=1.0)

    bad, good = await asyncio.gather(hostile(), calm(), return_exceptions=True)
    assert isinstance(bad, ProtocolError), bad
    assert good is None, good
    assert ended(rig.driver, rig.ledger, rig.store, "bad") == "episode_error"
    assert ended(rig.driver, rig.ledger, rig.store, "good") == "completed"
    assert [s["op"] for s in steps(rig.store, "bad")] == ["put", "exec"]


@pytest.mark.vm
async def test_eight_sessions_at_once(tiny_baseline: Baseline, tmp_path: Path) -> None:
    """Protects (real VMs): 8 sessions in parallel, each its own VM and record, all confirmed
    absent; none sees another's file."""
    rig = Rig(QemuDriver(), tiny_baseline, tmp_path)

    async def one(i: int) -> str:
        async with rig.open(f"p{i}") as sb:
            assert not await sb.files.exists("/tmp/mine")
            await sb.files.write("/tmp/mine", str(i))
            out = (await sb.commands.run("cat /tmp/mine")).stdout
            sb.finish(reward=float(i))
        return out

    assert await asyncio.gather(*(one(i) for i in range(8))) == [str(i) for i in range(8)]
    for i in range(8):
        assert ended(rig.driver, rig.ledger, rig.store, f"p{i}") == "completed"
    rig.ledger.close()


OWNER = """
import sys, time
from pathlib import Path
import cleanroom as cr
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
tmp = Path(sys.argv[1])
sb = cr.Session(sys.argv[2], ledger=Ledger(tmp / "ledger.db"), store=LocalStore(tmp / "store"),
                run_id="owned", timeout_s=600)
sb.open()
print(sb.episode.env_id, flush=True)
time.sleep(600)
"""


@pytest.mark.vm
async def test_sigkill_of_the_owner_takes_the_vm_and_reap_marks_it(
    tiny_baseline: Baseline, tmp_path: Path
) -> None:
    """Protects (real VM): a process holding a session open is SIGKILLed: its VM is gone
    within about a second (the deadman: it dies with its parent), and ``cleanroom reap`` marks
    the episode and confirms the env absent."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path), str(TINY_SPEC)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    env_id = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 300)
    env_id = env_id.strip()
    driver = QemuDriver()
    assert env_id and driver.alive(env_id)
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()
    while driver.alive(env_id) and time.monotonic() - killed < 5:
        await asyncio.sleep(0.05)
    gone_after = time.monotonic() - killed
    assert not driver.alive(env_id), "the VM outlived its owner"
    assert gone_after < 1.5, gone_after
    with Ledger(tmp_path / "ledger.db") as ledger:
        report = await reap(driver, ledger, LocalStore(tmp_path / "store"))
        assert ("owned", "session", 1) in report.episodes_marked
        [row] = ledger.episodes("owned")
        assert row.outcome == "infra_error"
        [env] = ledger.envs(run_id="owned")
        assert env.confirmed_absent_at is not None
    assert not driver.exists(env_id)

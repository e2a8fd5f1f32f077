"""A session's guest-caused failures are the guest's outcome, and small leftovers (issue 30).

On the fake driver (the real C agent as a host process):
- a guest that offers a file name the host refuses (``files.download_dir``, ``files.list``) ends
  the session ``episode_error``, final, with a durable record (it ended ``infra_error``, no
  record: the name was judged outside the session's guard);
- ``finish(artifacts=[x, x])`` lists ``x`` once;
- a session leaves no empty ``staging/<run>/<episode>`` folder behind;
- a secret printed through ``xxd``/``od`` is not at rest in hex in the transcript.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import UnsafePath
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import session
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline
from .kit import ended, folder, root, steps

SECRET = "hx_S3cretT0kenValue42"


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[FakeDriver, Ledger, LocalStore]]:
    with Ledger(tmp_path / "ledger.db") as ledger:
        yield FakeDriver(run_root=tmp_path / "run"), ledger, LocalStore(tmp_path / "store")


def _open(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore], run_id: str, **kw: Any
) -> Any:
    driver, ledger, store = parts
    options = RunOptions(cleanup_window_s=10, staging_dir=tmp_path / "staging")
    return session(
        make_fake_baseline(tmp_path),
        driver=driver,
        ledger=ledger,
        store=store,
        run_id=run_id,
        options=options,
        **kw,
    )


def record(store: LocalStore, run_id: str) -> dict[str, Any]:
    data = store.get_record(run_id, "session")
    assert data is not None, "no durable record"
    return data


@pytest.mark.parametrize("call", ["download_dir", "list"])
async def test_a_refused_guest_file_name_is_the_guests_outcome(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore], call: str
) -> None:
    driver, ledger, store = parts
    run_id = f"n-{call.replace('_', '-')}"
    with pytest.raises(UnsafePath, match=r"control character|guest file name"):
        async with _open(tmp_path, parts, run_id) as sb:
            top = root(driver, sb)
            made = await sb.commands.run(
                ["sh", "-c", f"mkdir -p {top}/out && touch '{top}/out/a\nb'"]
            )
            assert made.exit_code == 0
            if call == "download_dir":
                await sb.files.download_dir(f"{top}/out", tmp_path / "here")
            else:
                await sb.files.list(f"{top}/out")
    assert ended(driver, ledger, store, run_id) == "episode_error"
    rec = record(store, run_id)
    assert rec["outcome"] == "episode_error" and "UnsafePath" in rec["error"]["message"]


async def test_an_artifact_named_twice_is_listed_once(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    driver, ledger, store = parts
    async with _open(tmp_path, parts, "twice") as sb:
        top = root(driver, sb)
        await sb.files.write(f"{top}/tmp/x.txt", "x")
        sb.finish(reward=1.0, artifacts=[f"{top}/tmp/x.txt", f"{top}/tmp/x.txt"])
    assert ended(driver, ledger, store, "twice") == "completed"
    names = [a["name"] for a in record(store, "twice")["artifacts"]]
    assert names == [f"{top}/tmp/x.txt".lstrip("/")]
    finish = [s for s in steps(store, "twice") if s["op"] == "finish"]
    assert finish[0]["artifacts"] == [f"{top}/tmp/x.txt"]


async def test_a_session_leaves_no_staging_folder(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore]
) -> None:
    driver, ledger, store = parts
    async with _open(tmp_path, parts, "st") as sb:
        await sb.commands.run("true")
        sb.finish(reward=0.0)
    assert ended(driver, ledger, store, "st") == "completed"
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "staging").rglob("*"))
    assert left == []


async def test_a_secret_printed_as_hex_is_not_in_the_transcript(
    tmp_path: Path, parts: tuple[FakeDriver, Ledger, LocalStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEX_TOKEN", SECRET)
    driver, ledger, store = parts
    async with _open(tmp_path, parts, "hx", secrets=["HEX_TOKEN"]) as sb:
        for dump in ("xxd", "xxd -p", "od -v -An -tx1", "od -v -x"):
            r = await sb.commands.run(f'printf "%s" "$HEX_TOKEN" | {dump}')
            assert r.exit_code == 0
        sb.finish(reward=1.0)
    assert ended(driver, ledger, store, "hx") == "completed"
    words = SECRET.encode()
    probes = {words[i : i + 4].hex() for i in range(0, len(words) - 4)}
    for path in folder(store, "hx").rglob("*"):
        if path.is_file():
            text = path.read_bytes().decode(errors="replace").lower()
            flat = text.replace(" ", "").replace("\n", "")
            assert not any(p in flat for p in probes), path
    said = [json.dumps(s) for s in steps(store, "hx") if s["op"] == "exec"]
    assert all("[REDACTED:HEX_TOKEN]" in s for s in said)


@pytest.mark.vm
async def test_on_a_real_vm_hex_is_redacted_and_a_refused_name_is_the_guests(
    tiny_baseline: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same two on QEMU (TCG here): the guest's own ``od`` prints the secret as hex, and
    a file name with a newline in ``download_dir`` ends the session ``episode_error``."""
    from cleanroom.drivers.qemu import QemuDriver

    monkeypatch.setenv("HEX_TOKEN", SECRET)
    driver = QemuDriver()
    with Ledger(tmp_path / "ledger.db") as ledger:
        store = LocalStore(tmp_path / "store")
        options = RunOptions(cleanup_window_s=30, staging_dir=tmp_path / "staging")
        with pytest.raises(UnsafePath):
            async with session(
                tiny_baseline,
                driver=driver,
                ledger=ledger,
                store=store,
                run_id="vm",
                options=options,
                secrets=["HEX_TOKEN"],
            ) as sb:
                for dump in ("od -v -An -tx1", "od -v -x"):
                    r = await sb.commands.run(f'printf "%s" "$HEX_TOKEN" | {dump}')
                    assert r.exit_code == 0 and r.stdout.strip()
                made = await sb.commands.run(["sh", "-c", "mkdir -p /tmp/o && touch '/tmp/o/a\nb'"])
                assert made.exit_code == 0
                await sb.files.download_dir("/tmp/o", tmp_path / "here")
        assert ended(driver, ledger, store, "vm") == "episode_error"
    rec = record(store, "vm")
    assert rec["outcome"] == "episode_error" and "UnsafePath" in rec["error"]["message"]
    words = SECRET.encode()
    probes = {words[i : i + 4].hex() for i in range(0, len(words) - 4)}
    probes |= {
        bytes([b, a]).hex() + bytes([d, c]).hex()
        for a, b, c, d in zip(words, words[1:], words[2:], words[3:], strict=False)
    }
    for path in folder(store, "vm").rglob("*"):
        if path.is_file():
            flat = path.read_bytes().decode(errors="replace").lower()
            flat = flat.replace(" ", "").replace("\n", "")
            assert not any(p in flat for p in probes), path
    said = [json.dumps(s) for s in steps(store, "vm") if s["op"] == "exec"]
    assert sum("[REDACTED:HEX_TOKEN]" in s for s in said) == 2

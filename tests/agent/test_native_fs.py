"""The native agent's FS requests (``agent/native/mux.c``: stat, list, mkdir, rename, remove),
driven by the real host side (``AgentConnection.fs``, ``agent/fs.py``) over a unix socket; and
the host's parser of their answers against what a hostile guest could send."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.agent.test_native_agent import drive, pytestmark  # noqa: F401

from cleanroom.agent import fs, native
from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import GuestFileNotFound, GuestOperationError


@pytest.fixture(scope="module")
def agent_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native-fs") / native.BINARY
    subprocess.run(native.gcc_argv(out), cwd=native.NATIVE_DIR, check=True)
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def test_stat_list_mkdir_rename_remove(agent_binary: Path, root: Path) -> None:
    """Protects: stat of a file, a folder and a link (never followed; its target reported);
    list with depth (links to folders not entered); mkdir with parents; rename; remove of a
    whole tree; a missing path is ``GuestFileNotFound``; a name with a newline and non-UTF-8
    bytes comes back as it is."""
    (root / "a").mkdir()
    (root / "a" / "f.txt").write_bytes(b"12345")
    (root / "a" / "b").mkdir()
    (root / "a" / "b" / "deep").write_bytes(b"")
    (root / "a" / "to-b").symlink_to(root / "a" / "b")
    odd = os.fsencode(str(root / "a")) + b"/new\nline\xff"
    open(odd, "wb").close()

    async def body(session: AgentConnection) -> None:
        [f] = (await session.fs("stat", f"{root}/a/f.txt")).entries
        mode = os.stat(root / "a" / "f.txt").st_mode & 0o7777
        assert (f.type, f.size, f.mode, f.uid) == ("file", 5, mode, os.getuid())
        [link] = (await session.fs("stat", f"{root}/a/to-b")).entries
        assert link.type == "symlink" and link.target == str(root / "a" / "b")
        one = {e.path for e in (await session.fs("list", f"{root}/a")).entries}
        assert one == {f"{root}/a/f.txt", f"{root}/a/b", f"{root}/a/to-b", os.fsdecode(odd)}
        two = {e.path for e in (await session.fs("list", f"{root}/a", depth=2)).entries}
        assert two == one | {f"{root}/a/b/deep"}  # the link to b is not entered
        await session.fs("mkdir", f"{root}/x/y/z")
        assert (root / "x" / "y" / "z").is_dir()
        await session.fs("rename", f"{root}/a/f.txt", dest=f"{root}/x/moved.txt")
        assert (root / "x" / "moved.txt").read_bytes() == b"12345"
        await session.fs("remove", f"{root}/a")
        assert not (root / "a").exists() and (root / "a").parent.exists()
        assert (root / "a" / "b").exists() is False
        with pytest.raises(GuestFileNotFound):
            await session.fs("stat", f"{root}/none")
        with pytest.raises(GuestOperationError):
            await session.fs("list", f"{root}/x/moved.txt")  # not a folder

    drive(agent_binary, root, body)


def test_the_entries_of_a_listing_bigger_than_an_answer_are_cut_whole(
    agent_binary: Path, root: Path
) -> None:
    """Protects: a folder whose listing passes the answer's limit comes back truncated, every
    entry in it whole (the host parses it: no half entry)."""
    big = root / "big"
    big.mkdir()
    for i in range(6000):
        (big / (f"{i:05d}-" + "n" * 200)).touch()

    async def body(session: AgentConnection) -> None:
        listing = await session.fs("list", str(big))
        assert listing.truncated and 1000 < len(listing.entries) < 6000
        assert all(e.type == "file" for e in listing.entries)

    drive(agent_binary, root, body)


@given(st.binary(max_size=400))
def test_the_host_parser_takes_any_bytes_safely(body: bytes) -> None:
    """Protects: whatever a guest sends as FS entries parses or is a ValueError (the host
    then breaks the channel: ``ProtocolError``), never another exception."""
    with contextlib.suppress(ValueError):
        fs.parse(body)

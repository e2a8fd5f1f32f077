"""Tar uploads and downloads on the native agent (``agent/native/tar.c``, ``tarpack.c``) as a host
process, driven by the real host side (``AgentConnection``, ``transfers``) over a socket.

Each test protects what the removed Python agent's ``agent/tarsafe.py`` promised, now in C: a folder
packed (files, folders, links, hard links, long and non-ASCII names in pax) reads back with Python's
``tarfile`` as the removed Python agent's pack did; an archive from ``tarfile`` (ustar, GNU, pax)
unpacks with its modes' permission bits only; every member that would land outside the folder
(``..``, absolute, through a link already there, a link pointing out, a device node) is
``GuestUnsafePath`` and nothing lands outside; a corrupt archive is a typed error and the agent goes
on. On the old native agent every one of these was ``Unsupported`` (tar not served)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.agent.tarsafe_ref import pack
from tests.agent.test_mux import hostile_member, make_tar, one
from tests.agent.test_native_agent import drive, pytestmark  # noqa: F401

from cleanroom.agent import native, protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.errors import GuestFileNotFound, GuestOperationError, GuestUnsafePath


@pytest.fixture(scope="module")
def agent_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native-tar") / native.BINARY
    subprocess.run(native.gcc_argv(out), cwd=native.NATIVE_DIR, check=True)
    return out


LONG = "a-folder-name-of-more-than-a-hundred-bytes-" * 3  # a pax path


def members(archive: bytes) -> list[tuple[str, int, int, str, bytes]]:
    """(name, type, permission bits, link, data) of each member, in order."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for m in tar:
            data = tar.extractfile(m).read() if m.isreg() else b""  # type: ignore[union-attr]
            out.append((m.name, ord(m.type), m.mode & 0o7777, m.linkname, data))
    return out


def python_pack(src: Path) -> bytes:
    """The folder as the Python agent packs it (``tests/agent/tarsafe_ref.py``)."""

    class Sink:
        data = bytearray()

        def write(self, chunk: bytes) -> bool:
            self.data += chunk
            return True

    sink = Sink()
    pack(str(src), sink)
    return bytes(sink.data)


def folder(src: Path) -> None:
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"alpha")
    (src / "sub" / "deeper" / "b.bin").write_bytes(os.urandom(protocol.WINDOW + 5))
    (src / "sub" / "link").symlink_to("deeper/b.bin")
    (src / "sub" / "to-folder").symlink_to("deeper")
    os.link(src / "a.txt", src / "sub" / "hard")
    (src / LONG).mkdir()
    (src / LONG / ("é-" * 60 + ".txt")).write_bytes(b"pax")
    (src / "x.sh").write_bytes(b"#!/bin/sh\n")
    (src / "x.sh").chmod(0o750)
    (src / "empty").write_bytes(b"")


def test_a_folder_packs_as_the_python_agent_packs_it_and_unpacks_again(
    agent_binary: Path, tmp_path: Path
) -> None:
    """Download: the same members, order, types, modes, links and bytes as ``tarsafe_ref.pack``
    (a window's worth and more, so ACKs must flow); upload of that archive into another
    folder gives the same tree back."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    folder(src)

    async def body(session: AgentConnection) -> bytes:
        archive = bytearray()
        async for chunk in session.get_tar(str(src)):
            archive.extend(chunk)
        size = await session.put_tar(str(dest), one(bytes(archive)))
        assert size == len(archive)
        return bytes(archive)

    archive = drive(agent_binary, tmp_path, body)
    assert len(archive) % 10240 == 0
    assert members(archive) == members(python_pack(src))
    for rel in (
        "a.txt",
        "sub/deeper/b.bin",
        "sub/hard",
        "x.sh",
        "empty",
        f"{LONG}/{'é-' * 60}.txt",
    ):
        assert (dest / rel).read_bytes() == (src / rel).read_bytes()
        assert stat.S_IMODE((dest / rel).stat().st_mode) == stat.S_IMODE((src / rel).stat().st_mode)
    assert os.readlink(dest / "sub" / "link") == "deeper/b.bin"
    assert os.readlink(dest / "sub" / "to-folder") == "deeper"
    assert (dest / "a.txt").stat().st_ino == (dest / "sub" / "hard").stat().st_ino


def test_an_archive_from_tarfile_unpacks_in_every_format(
    agent_binary: Path, tmp_path: Path
) -> None:
    """ustar (a long name split into prefix and name), GNU (an 'L' header) and pax (a 'path'
    record); a mode keeps its permission bits only (no setuid); a file there is replaced."""
    names = {"ustar": "d/" + "u" * 99, "gnu": "d/" + "g" * 150, "pax": "d/" + "p" * 150}
    formats = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}

    def archive(label: str) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=formats[label]) as tar:
            for member, data in ((names[label], b"long"), ("d/s", b"suid"), ("d/s", b"again")):
                info = tarfile.TarInfo(member)
                info.size, info.mode = len(data), 0o4755
                tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    async def body(session: AgentConnection) -> None:
        for label in formats:
            await session.put_tar(str(tmp_path / label), one(archive(label)))

    drive(agent_binary, tmp_path, body)
    for label in formats:
        assert (tmp_path / label / names[label]).read_bytes() == b"long", label
        assert (tmp_path / label / "d" / "s").read_bytes() == b"again", label
        assert stat.S_IMODE((tmp_path / label / "d" / "s").stat().st_mode) == 0o755, label


@pytest.mark.parametrize(
    "case",
    ["dotdot", "absolute", "inner-dotdot", "through-a-link", "device", "link-outside",
     "absolute-link"],
)  # fmt: skip
def test_members_that_escape_are_refused(agent_binary: Path, tmp_path: Path, case: str) -> None:
    """Nothing lands outside the folder, not even through a link already inside it; no
    device node, no link pointing out (the cases ``test_mux`` holds the agent to)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "box" / "dest"
    dest.mkdir(parents=True)
    (dest / "l").symlink_to(outside)

    async def body(session: AgentConnection) -> None:
        with pytest.raises(GuestUnsafePath):
            archive = make_tar([(hostile_member(case, outside), b"x")])
            await session.put_tar(str(dest), one(archive))
        assert (await session.exec(["true"])).ok

    drive(agent_binary, tmp_path, body)
    assert not (tmp_path / "box" / "escaped").exists() and not list(outside.iterdir())
    assert not Path("/tmp/absolute-escape").exists()
    assert not (dest / "dev").exists() and not (dest / "out").exists()
    assert not (dest / "abs").exists()


def test_names_and_links_the_host_would_refuse_are_refused(
    agent_binary: Path, tmp_path: Path
) -> None:
    """names.problem in C: a control character, a backslash, invalid UTF-8, a component over
    255 bytes, a hard link to outside or to the folder itself; and a member replacing a
    folder. Each is ``GuestUnsafePath``; members before it stay unpacked."""
    dest = tmp_path / "dest"

    def member(name: str | bytes, **fields: object) -> tarfile.TarInfo:
        info = tarfile.TarInfo(
            name if isinstance(name, str) else name.decode("utf-8", "surrogateescape")
        )
        for key, value in fields.items():
            setattr(info, key, value)
        return info

    cases = [
        member("bad\x01name"),
        member("back\\slash"),
        member(b"bad-\xff-utf8"),
        member("x" * 256),
        member("hard", type=tarfile.LNKTYPE, linkname="../outside"),
        member("self", type=tarfile.LNKTYPE, linkname="./"),
        member("folder"),  # a file where a folder is
    ]

    async def body(session: AgentConnection) -> None:
        for info in cases:
            archive = make_tar(
                [
                    (member("first-ok"), b"1"),
                    (member("folder/", type=tarfile.DIRTYPE), b""),
                    (info, b"x"),
                ]
            )
            with pytest.raises(GuestUnsafePath):
                await session.put_tar(str(dest), one(archive))
        assert (await session.exec(["true"])).ok

    drive(agent_binary, tmp_path, body)
    assert (dest / "first-ok").read_bytes() == b"1" and (dest / "folder").is_dir()
    assert sorted(p.name for p in dest.iterdir()) == ["first-ok", "folder"]


def test_a_corrupt_archive_is_a_typed_error_and_the_agent_goes_on(
    agent_binary: Path, tmp_path: Path
) -> None:
    """A bad checksum, a file cut short, an empty stream, a compressed one: each is a
    ``GuestOperationError`` (bad_archive); a folder that is not there to pack is
    ``GuestFileNotFound``; the agent answers the next request."""
    good = make_tar([(tarfile.TarInfo("f"), b"0123456789" * 100)])
    corrupt = bytearray(good)
    corrupt[0] ^= 1  # the checksum no longer matches
    cut = good[: 512 + 300]

    async def chunks() -> AsyncIterator[bytes]:
        yield b""

    async def body(session: AgentConnection) -> None:
        for data in (bytes(corrupt), cut, b"", b"\x1f\x8b" + b"\0" * 600):
            with pytest.raises(GuestOperationError) as info:
                await session.put_tar(str(tmp_path / "dest"), one(data))
            assert not isinstance(info.value, GuestUnsafePath)
        with pytest.raises(GuestFileNotFound):
            async for _ in session.get_tar(str(tmp_path / "no-such-folder")):
                pass
        assert (await session.exec(["true"])).ok

    drive(agent_binary, tmp_path, body)

"""The pure-Python newc cpio writer and the initramfs it builds."""

from __future__ import annotations

import io
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from cleanroom.baseline.initramfs import Entry, build_initramfs, initramfs_entries, write_newc
from cleanroom.baseline.kernel import Kernel
from cleanroom.baseline.spec import INIT_SCRIPT
from cleanroom.errors import BuildError


def parse_newc(data: bytes) -> list[tuple[str, int, int, int, bytes]]:
    """(name, mode, mtime, uid, data) of every member, checking the format as we go."""
    members = []
    offset = 0
    while True:
        assert offset % 4 == 0
        assert data[offset : offset + 6] == b"070701"
        fields = [int(data[offset + 6 + 8 * i : offset + 14 + 8 * i], 16) for i in range(13)]
        _, mode, uid, _, _, mtime, size, *_, namesize, _ = fields
        name_start = offset + 110
        name = data[name_start : name_start + namesize - 1].decode()
        body_start = name_start + namesize + (-(110 + namesize) % 4)
        body = data[body_start : body_start + size]
        offset = body_start + size + (-size % 4)
        if name == "TRAILER!!!":
            assert offset == len(data)
            return members
        members.append((name, mode, mtime, uid, body))


def sample() -> list[Entry]:
    return [
        Entry.file("bin/tool", b"#!/bin/sh\necho hi\n", 0o755),
        Entry.dir("bin"),
        Entry.file("etc/odd", b"x" * 5),
        Entry.dir("etc"),
        Entry.chardev("dev/console", 5, 1),
        Entry.dir("dev"),
        Entry.file("init", b"#!/bin/sh\n", 0o755),
    ]


def render(entries: list[Entry]) -> bytes:
    buffer = io.BytesIO()
    write_newc(entries, buffer)
    return buffer.getvalue()


def test_the_writer_is_byte_reproducible_and_sorted() -> None:
    first = render(sample())
    assert render(list(reversed(sample()))) == first
    members = parse_newc(first)
    assert [m[0] for m in members] == sorted(m[0] for m in members)
    assert all(mtime == 0 and uid == 0 for _, _, mtime, uid, _ in members)
    by_name = {m[0]: m for m in members}
    assert by_name["etc/odd"][4] == b"xxxxx"
    assert stat.S_ISCHR(by_name["dev/console"][1])
    assert stat.S_IMODE(by_name["bin/tool"][1]) == 0o755


def test_the_writer_refuses_bad_trees() -> None:
    with pytest.raises(BuildError, match="no parent"):
        render([Entry.file("a/b", b"")])
    with pytest.raises(BuildError, match="duplicate"):
        render([Entry.file("a", b""), Entry.file("a", b"")])
    with pytest.raises(BuildError, match="bad entry name"):
        render([Entry.file("../escape", b"")])


@pytest.mark.skipif(shutil.which("cpio") is None, reason="GNU cpio is not installed")
def test_gnu_cpio_reads_it(tmp_path: Path) -> None:
    archive = tmp_path / "x.cpio"
    archive.write_bytes(render(sample()))
    listing = subprocess.run(
        ["cpio", "-it", "--quiet"], stdin=archive.open("rb"), capture_output=True, check=True
    ).stdout.decode()
    assert listing.split() == sorted(e.name for e in sample())


def fake_kernel(tmp_path: Path) -> Kernel:
    modules = tmp_path / "modules"
    modules.mkdir()
    for name in ("virtio", "erofs"):
        (modules / f"{name}.ko").write_bytes(name.encode() * 10)
    return Kernel("6.1.0-test", tmp_path / "vmlinux", modules, ("virtio", "erofs"))


def test_the_initramfs_has_what_init_needs(tmp_path: Path) -> None:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF fake busybox")
    members = {
        m[0]: m for m in parse_newc(render(initramfs_entries(fake_kernel(tmp_path), busybox)))
    }
    for folder in ("dev", "proc", "sys", "lower", "upper", "newroot", "lib/modules"):
        assert stat.S_ISDIR(members[folder][1]), folder
    assert members["init"][4] == INIT_SCRIPT.read_bytes()
    assert stat.S_IMODE(members["init"][1]) == 0o755
    assert members["bin/busybox"][4] == busybox.read_bytes()
    assert members["lib/modules/order"][4] == b"virtio\nerofs\n"
    assert members["lib/modules/erofs.ko"][4] == b"erofs" * 10


def test_build_initramfs_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"bb")
    kernel = fake_kernel(tmp_path)
    build_initramfs(kernel, tmp_path / "a.cpio", busybox)
    (tmp_path / "modules" / "erofs.ko").touch()  # a newer mtime must not matter
    build_initramfs(kernel, tmp_path / "b.cpio", busybox)
    assert (tmp_path / "a.cpio").read_bytes() == (tmp_path / "b.cpio").read_bytes()


def test_a_missing_busybox_is_a_build_error(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="busybox"):
        initramfs_entries(fake_kernel(tmp_path), tmp_path / "nope")

"""Filesystem operations of a multiplexing guest (HELLO ``features`` has "fs"): ``native/mux.c``.

One FS request ``{id, op, path, dest, depth}`` per call; the guest answers FAILED (a missing
path: ``GuestFileNotFound``) or DONE ``{size, truncated}`` whose body is the entries. Each entry
is eight NUL-ended fields (path, type, size, mode, uid, gid, mtime, link target), parsed here
within bounds: a guest that sends anything else breaks the protocol (``ProtocolError``); a
name is only data (reported, never used as a host path).
"""

from __future__ import annotations

from dataclasses import dataclass

from cleanroom.agent import protocol
from cleanroom.agent.channel import Channel
from cleanroom.agent.protocol import Kind
from cleanroom.agent.transfers import failure, violation

OPS = ("stat", "list", "mkdir", "rename", "remove")
FIELDS = 8
TYPES = {
    "f": "file",
    "d": "dir",
    "l": "symlink",
    "p": "fifo",
    "s": "socket",
    "c": "char",
    "b": "block",
    "?": "other",
}


@dataclass(frozen=True)
class Entry:
    """One guest path as its ``lstat`` saw it."""

    path: str
    type: str  # file, dir, symlink, fifo, socket, char, block, other
    size: int
    mode: int  # permission bits
    uid: int
    gid: int
    mtime: float
    target: str  # a link's target ("" for none)


@dataclass(frozen=True)
class Listing:
    entries: list[Entry]
    truncated: bool  # the guest stopped at its answer's size limit


def _int(text: str, base: int = 10) -> int:
    if not text or len(text) > 24 or not text.isascii() or not text.isalnum():
        raise ValueError(text)
    return int(text, base)


def parse(body: bytes) -> list[Entry]:
    """The entries of a DONE body (``ValueError`` for anything malformed)."""
    if not body:
        return []
    if not body.endswith(b"\0"):
        raise ValueError("the entries do not end with NUL")
    parts = body[:-1].split(b"\0")
    if len(parts) % FIELDS:
        raise ValueError(f"{len(parts)} fields, not a multiple of {FIELDS}")
    out = []
    for i in range(0, len(parts), FIELDS):
        path, kind, size, mode, uid, gid, mtime, target = (
            p.decode("utf-8", "surrogateescape") for p in parts[i : i + FIELDS]
        )
        if kind not in TYPES or not path.startswith("/"):
            raise ValueError(f"entry {i // FIELDS}: bad type or path")
        seconds, _, nanos = mtime.partition(".")
        out.append(
            Entry(
                path,
                TYPES[kind],
                _int(size),
                _int(mode, 8),
                _int(uid),
                _int(gid),
                _int(seconds) + (_int(nanos) / 1e9 if nanos else 0.0),
                target,
            )
        )
    return out


async def request(
    channel: Channel, op: str, path: str, *, dest: str | None = None, depth: int = 1
) -> Listing:
    """One FS operation (``OPS``) on ``path`` (absolute); stat and list answer entries."""
    channel.require("fs", "filesystem operations")
    if op not in OPS:
        raise ValueError(f"FS op {op!r} is none of {OPS}")
    rid, inbox = channel.open()
    finished = False
    try:
        header = {"id": rid, "op": op, "path": path, "dest": dest, "depth": depth}
        await channel.send(Kind.FS, header)
        frame = await channel.take(inbox)
        finished = frame.kind in (Kind.DONE, Kind.FAILED)
        if frame.kind == Kind.FAILED:
            raise failure(frame.header)
        if frame.kind != Kind.DONE:
            name = protocol.kind_name(frame.kind)
            raise violation(channel, f"unexpected {name} answering FS")
        if frame.header.get("size") != len(frame.body):
            raise violation(channel, "FS: DONE's size is not its body's")
        try:
            entries = parse(frame.body)
        except ValueError as exc:
            raise violation(channel, f"FS {op}: malformed entries: {exc}") from exc
        return Listing(entries, frame.header.get("truncated") is True)
    finally:
        channel.close(rid, finished=finished)

"""Fuzz targets: the host's guest-facing parsers and the operator's loaders, one function each.

Each target takes arbitrary bytes and may raise only the typed errors listed in ``ALLOWED``
(anything else is a bug: the fuzzers report it, ``check`` raises it). They are shared by the
coverage-guided fuzzer (``fuzz.py``, atheris), the replay of the committed corpus and crash
reproducers, and the property tests (``test_fuzz.py``).

- ``header``: a frame header (``wire.decode_header``).
- ``result``: ``result.json`` (``parse_guest_result``), then what export does with it: redact
  it as JSON and serialize it as strict UTF-8 JSON (the durable record's form).
- ``name``: an artifact name; an accepted one must be creatable inside its folder.
- ``stream``: the guest's whole byte stream as the answer to a request (the first byte picks
  RUN, PING or HELLO): frames, headers, answers, artifact names, result chunks, quota; nothing
  may be written outside the episode's temporary staging folder.
- ``mux``: the same for a multiplexing agent (HELLO ``features``): the first byte picks exec
  with stdin and callbacks, spawn then kill, get_stream, put_stream, get_tar or put_tar, all
  request id 1; only typed errors (``GuestOperationError`` included), nothing left running.
- ``bulk``: the same for an agent with a bulk disk (``agent.bulk``; a real disk file here): the
  first byte picks a put of a few bytes, a put of more than the disk (two pieces), a get or a
  get with a small quota; only typed errors, the disk file emptied after each, nothing written
  beside it.
- ``fs``: the same for an FS request (``agent/fs.py``; first byte: stat, list, mkdir, rename,
  remove): a DONE's entries parsed within bounds; only typed errors.
- ``manifest``: a manifests file (``parse_manifests``).
- ``spec``: a ``baseline.toml`` (``load_spec``).
- ``gym``: a Gymnasium answer (``cleanroom.gym.wire``): the first byte picks GYM_SPACES or
  GYM_OBS, the next four the header's length; the header, then the body (raw array bytes).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from cleanroom.agent import bulk, protocol, wire
from cleanroom.agent.bulk import BulkDisk
from cleanroom.agent.connection import AgentConnection
from cleanroom.baseline.spec import load_spec
from cleanroom.errors import (
    EnvCrashed,
    GuestOperationError,
    ManifestError,
    ProtocolError,
    SpecError,
    UnsafePath,
)
from cleanroom.evidence.manifest import parse_manifests
from cleanroom.evidence.record import parse_guest_result
from cleanroom.evidence.secrets import Redactor

KNOWN: dict[str, tuple[type[BaseException], ...]] = {}
"""Untyped errors of a target that are known and owned elsewhere: tolerated by ``fuzz.py`` (so
the rest of its input space is still explored), never by ``check``. None now: the spec loader's
deep-TOML RecursionError (tests/fuzz/crashes/spec-deep-array) is a SpecError."""

_SHM = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # a disk's rmdir costs ~2 ms
_TMP = Path(tempfile.mkdtemp(prefix="cleanroom-fuzz-", dir=_SHM))
_LOOP = asyncio.new_event_loop()
_REDACTOR = Redactor({"TOKEN": "s3cr3t-value"})


def header(data: bytes) -> None:
    wire.decode_header(data)


def result(data: bytes) -> None:
    guest = parse_guest_result(data)
    if guest.problem is None:
        record = {"reward": guest.reward, "info": guest.info, "metrics": guest.metrics}
        json.dumps(_REDACTOR.redact_json(record), allow_nan=False).encode("utf-8")


def name(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    rel = wire.guest_name(text)
    root = _TMP / "names"
    shutil.rmtree(root, ignore_errors=True)
    path = root / rel
    path.parent.mkdir(parents=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    assert root in path.resolve().parents, text


class _Writer:
    """The host's end of the channel: what it sends is discarded (the guest is the input)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


async def _answer(kind: int, session: AgentConnection, staging: Path) -> Any:
    if kind == 0:
        return await session.run_episode({"manifest": {}}, staging, quota_bytes=1 << 20)
    if kind == 1:
        return await session.ping()
    return await session.wait_hello()


def _fed_session(data: bytes, kinds: int) -> tuple[int, AgentConnection]:
    """The first byte (mod ``kinds``) picks what to ask; the rest is all the guest ever sends
    to a host session of it."""
    kind, guest_bytes = (data[0] % kinds, data[1:]) if data else (0, b"")
    reader = asyncio.StreamReader(loop=_LOOP)
    reader.feed_data(guest_bytes)
    reader.feed_eof()
    return kind, AgentConnection(reader, _Writer(), max_body=1 << 20)  # type: ignore[arg-type]


def stream(data: bytes) -> None:
    kind, session = _fed_session(data, 3)
    root = _TMP / "stream"
    shutil.rmtree(root, ignore_errors=True)
    staging = root / "staging"
    staging.mkdir(parents=True)
    try:
        _LOOP.run_until_complete(_answer(kind, session, staging))
    finally:
        outside = [p.name for p in root.iterdir() if p != staging]
        assert not outside, f"written outside the staging folder: {outside}"


async def _mux_answer(kind: int, session: AgentConnection) -> Any:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"z" * 300_000

    try:
        if kind == 0:
            seen: list[bytes] = []
            return await session.exec(["cat"], stdin=b"s" * 70_000, on_stdout=seen.append)
        if kind == 1:
            process = await session.spawn(["sleep", "9"])
            await process.kill()
            return await process.wait()
        if kind in (2, 4):
            stream = session.get_stream("/x") if kind == 2 else session.get_tar("/x")
            return [len(chunk) async for chunk in stream]
        if kind == 3:
            return await session.put_stream("/x", chunks())
        return await session.put_tar("/x", chunks())
    finally:
        await session.aclose()


def mux(data: bytes) -> None:
    kind, session = _fed_session(data, 6)
    session.channel.adopt_hello({"agent_version": "fuzz", "features": list(protocol.FEATURES)})
    _LOOP.run_until_complete(_mux_answer(kind, session))


async def _bulk_answer(kind: int, session: AgentConnection) -> Any:
    try:
        if kind == 0:
            return await session.put("/x", b"p" * 5000)
        if kind == 1:
            return await session.put("/x", b"q" * (bulk.SIZE + 1))
        return await session.get("/x", max_size=1 << 20 if kind == 2 else 10)
    finally:
        await session.aclose()


def bulk_disk(data: bytes) -> None:
    kind, session = _fed_session(data, 6)
    session.channel.adopt_hello({"agent_version": "fuzz", "features": list(protocol.FEATURES)})
    root = _TMP / "bulk"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    bulk.create(root / "disk")
    session.bulk = BulkDisk(root / "disk")
    try:
        _LOOP.run_until_complete(_bulk_answer(kind % 4, session))
    finally:
        assert [p.name for p in root.iterdir()] == ["disk"], "written beside the bulk disk"
        left = (root / "disk").stat()
        assert left.st_size == bulk.SIZE and left.st_blocks == 0, "the bulk disk was not emptied"


async def _fs_answer(kind: int, session: AgentConnection) -> Any:
    try:
        op = ("stat", "list", "mkdir", "rename", "remove")[kind % 5]
        return await session.fs(op, "/x", dest="/y", depth=3)
    finally:
        await session.aclose()


def fs(data: bytes) -> None:
    kind, session = _fed_session(data, 6)
    session.channel.adopt_hello({"agent_version": "fuzz", "features": list(protocol.FEATURES)})
    _LOOP.run_until_complete(_fs_answer(kind, session))


def manifest(data: bytes) -> None:
    parse_manifests(data.decode("utf-8", "replace"), "<fuzz>")


def spec(data: bytes) -> None:
    folder = _TMP / "spec"
    folder.mkdir(exist_ok=True)
    path = folder / "baseline.toml"
    path.write_bytes(data)
    load_spec(path)


def gym(data: bytes) -> None:
    from cleanroom.agent.protocol import Frame, Kind
    from cleanroom.gym import wire as gym_wire

    if len(data) < 5:
        return
    size = int.from_bytes(data[1:5], "big")
    header, body = wire.decode_header(data[5 : 5 + size]), data[5 + size :]
    if data[0] % 2:
        frame = Frame(Kind.GYM_SPACES, header, body)
        gym_wire.spaces_of(gym_wire.value(frame, Kind.GYM_SPACES))
    else:
        frame = Frame(Kind.GYM_OBS, header, body)
        gym_wire.step(frame, gym_wire.value(frame, Kind.GYM_OBS))


TARGETS: dict[str, Callable[[bytes], None]] = {
    "header": header,
    "result": result,
    "name": name,
    "stream": stream,
    "mux": mux,
    "bulk": bulk_disk,
    "fs": fs,
    "manifest": manifest,
    "spec": spec,
    "gym": gym,
}
ALLOWED: dict[str, tuple[type[BaseException], ...]] = {
    "header": (ProtocolError,),
    "result": (),
    "name": (UnsafePath,),
    "stream": (ProtocolError, EnvCrashed),
    "mux": (ProtocolError, EnvCrashed, GuestOperationError),
    "bulk": (ProtocolError, EnvCrashed, GuestOperationError),
    "fs": (ProtocolError, EnvCrashed, GuestOperationError),
    "manifest": (ManifestError,),
    "spec": (SpecError,),
    "gym": (ProtocolError,),
}


def check(target: str, data: bytes) -> None:
    """Run one input; the target's typed errors are a valid answer, anything else raises."""
    try:
        TARGETS[target](data)
    except ALLOWED[target]:
        pass

"""The frame codec: round trips, and every kind of malformed input is refused before allocation."""

from __future__ import annotations

import io

import pytest

from cleanroom.agent import protocol
from cleanroom.agent.protocol import BadFrame, Kind, TooLarge, encode, read_frame


def test_round_trip_header_and_body() -> None:
    data = encode(Kind.FILE, {"name": "a/b.txt", "offset": 0, "eof": True}, b"\x00\xffbytes")
    frame = read_frame(io.BytesIO(data))
    assert frame.kind == Kind.FILE
    assert frame.header == {"name": "a/b.txt", "offset": 0, "eof": True}
    assert frame.body == b"\x00\xffbytes"


def test_bad_magic_is_refused() -> None:
    data = bytearray(encode(Kind.PING))
    data[0:2] = b"XX"
    with pytest.raises(BadFrame, match="magic"):
        read_frame(io.BytesIO(bytes(data)))


def test_unknown_type_is_refused() -> None:
    data = protocol.PREFIX.pack(protocol.MAGIC, 200, 2, 0) + b"{}"
    with pytest.raises(BadFrame, match="unknown frame type"):
        read_frame(io.BytesIO(data))


def test_oversized_body_refused_from_prefix_alone() -> None:
    # declares 2 GiB but sends nothing: the reader must refuse without trying to read it
    data = protocol.PREFIX.pack(protocol.MAGIC, int(Kind.STDOUT), 2, 2**31 - 1) + b"{}"
    with pytest.raises(TooLarge):
        read_frame(io.BytesIO(data), max_body=1024)


def test_oversized_header_refused() -> None:
    data = protocol.PREFIX.pack(protocol.MAGIC, int(Kind.HELLO), protocol.MAX_HEADER + 1, 0)
    with pytest.raises(TooLarge):
        read_frame(io.BytesIO(data))


@pytest.mark.parametrize("raw", [b"not json", b"[1,2]", b"\xff\xfe"])
def test_header_must_be_json_object(raw: bytes) -> None:
    data = protocol.PREFIX.pack(protocol.MAGIC, int(Kind.HELLO), len(raw), 0) + raw
    with pytest.raises(BadFrame):
        read_frame(io.BytesIO(data))


def test_truncated_stream_is_eof() -> None:
    data = encode(Kind.STDOUT, {}, b"hello")[:-2]
    with pytest.raises(EOFError):
        read_frame(io.BytesIO(data))

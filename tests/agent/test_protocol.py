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


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, None, True, False], "b": {"c": 'é\n\x00"\\'}, "d": -0.0, "e": 10**30},
        {"nan": float("inf"), "t": 1.0e-7, "s": "\u2603" * 3},
        {},
        [],
        "x",
    ],
)
def test_dumps_and_loads_match_json(value: object) -> None:
    import json

    for separators in ((",", ":"), (", ", ": ")):
        assert protocol.dumps(value, separators) == json.dumps(value, separators=separators)
    text = json.dumps(value)
    assert protocol.loads(text) == json.loads(text)
    assert protocol.loads(" " + text + "\n") == json.loads(text)  # whitespace: json's own path


def test_loads_names_malformed_input_like_json() -> None:
    import json

    for text in ('{"a": }', '{"a": 1', "[1,]", '"\x01"', "1 2"):
        with pytest.raises(json.JSONDecodeError):
            protocol.loads(text)


def test_dumps_refuses_what_json_refuses() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        protocol.dumps({"a": object()})
    with pytest.raises(ValueError, match="Circular"):
        looped: list[object] = []
        looped.append(looped)
        protocol.dumps(looped)

"""The host's one boundary for guest bytes (``agent/wire.py``): whatever arrives ends as a safe
value or a ``ProtocolError`` subclass, and every limit holds at its edge (limit accepted, one
more refused, typed). On the old code a deep document raised ``RecursionError``, a lone
surrogate name ``UnicodeEncodeError`` at ``os.open``, a 300-byte component ``OSError``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.agent import protocol, wire
from cleanroom.agent.connection import AgentConnection
from cleanroom.agent.protocol import Kind, encode
from cleanroom.errors import FrameTooLarge, ProtocolError, UnsafePath
from cleanroom.evidence.record import parse_guest_result


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "raw",
    [
        nested(100_000),
        b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
        b"NaN",
        b"[Infinity]",
        b"[-Infinity]",
        b"[1e999]",
        b"[-1e999]",
        b"[" + b"9" * 5000 + b"]",
        b"[9223372036854775808]",
        b'["x\\ud800y"]',
        b'{"\\udc80": 1}',
        b"\xed\xa0\x80",  # a surrogate encoded as UTF-8 (CESU): invalid UTF-8
        b"\xff",
        b"[1,]",
        b"",
    ],
)
def test_hostile_json_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode_json(raw, wire.RESULT, "doc")


def test_depth_limit_at_its_edge() -> None:
    limit = protocol.MAX_JSON_DEPTH
    assert wire.decode_json(nested(limit), wire.RESULT, "doc") is not None
    with pytest.raises(ProtocolError, match="deeper"):
        wire.decode_json(nested(limit + 1), wire.RESULT, "doc")


def test_integer_limit_at_its_edge() -> None:
    top = protocol.MAX_JSON_INT
    assert wire.decode_json(f"[{top}, {-top}]".encode(), wire.RESULT, "doc") == [top, -top]
    with pytest.raises(ProtocolError, match="range"):
        wire.decode_json(f"[{top + 1}]".encode(), wire.RESULT, "doc")


def test_item_and_size_limits_at_their_edge() -> None:
    limits = wire.JsonLimits(max_bytes=64, max_items=4)
    assert wire.decode_json(b"[1,2,3]", limits, "doc") == [1, 2, 3]  # the list + 3 = 4 values
    with pytest.raises(ProtocolError, match="more than 4"):
        wire.decode_json(b"[1,2,3,4]", limits, "doc")
    assert wire.decode_json(b'"' + b"x" * 62 + b'"', limits, "doc") == "x" * 62
    with pytest.raises(FrameTooLarge):
        wire.decode_json(b'"' + b"x" * 63 + b'"', limits, "doc")


def test_result_size_limit_at_its_edge() -> None:
    """``result.json`` is documented up to RESULT_MAX_BYTES: exactly that is a valid result."""
    head = b'{"reward": 1, "pad": "'
    pad = protocol.RESULT_MAX_BYTES - len(head) - 2
    assert parse_guest_result(head + b"x" * pad + b'"}').problem is None
    problem = parse_guest_result(head + b"x" * (pad + 1) + b'"}').problem
    assert problem is not None and "larger than" in problem


@pytest.mark.parametrize(
    "raw", [b'{"reward": 1, "info": {"x": 1e999}}', b'{"reward": 1, "metrics": [NaN]}']
)
def test_non_finite_numbers_anywhere_in_a_result_are_the_guests_problem(raw: bytes) -> None:
    """Before, only ``reward`` was checked: NaN in metrics failed at export (export_failed)."""
    assert parse_guest_result(raw).problem is not None


def test_a_deep_result_is_the_guests_problem_not_a_crash() -> None:
    problem = parse_guest_result(b'{"reward": 1, "info": ' + nested(100_000) + b"}").problem
    assert problem is not None and "deeper" in problem


@pytest.mark.parametrize(
    "name",
    [
        "x\ud800y",
        "\udcff",
        "a\x01b",
        "a\nb",
        "a\x7fb",
        "a\u0085b",
        "a\\b",
        "x" * 256,
        "d/" + "x" * 300,
        "/".join(["d"] * (protocol.MAX_NAME_PARTS + 1)),
        "é" * 128,  # 256 bytes in one component
        17,
        None,
    ],
)
def test_unsafe_names_are_refused(name: object) -> None:
    with pytest.raises(UnsafePath):
        wire.guest_name(name)


def test_name_limits_at_their_edge() -> None:
    part = "x" * protocol.MAX_NAME_PART
    assert str(wire.guest_name(part)) == part
    assert str(wire.guest_name("é" * 127 + "x")) == "é" * 127 + "x"  # 255 bytes
    full = "/".join(["x" * 254] * 4) + "/xxxx"
    assert len(full) == protocol.MAX_NAME and str(wire.guest_name(full)) == full
    with pytest.raises(UnsafePath, match="bytes"):
        wire.guest_name(full + "x")


def test_guest_text_is_printable_and_bounded() -> None:
    shown = wire.guest_text("a\x1b[31mb\ud800" + "x" * 2000, 20)
    assert shown.isprintable() and "\x1b" not in shown and len(shown) <= 21
    assert wire.guest_text(["not", "text"]) == "<list>"


def test_guest_text_escapes_say_which_character_it_was() -> None:
    """C0/C1 controls and DEL as ``\\xNN``, a lone surrogate as ``\\uNNNN`` (what a reader
    of a log needs to tell them apart); printable text untouched."""
    assert wire.guest_text("a\x00b\x7f\x9fc") == "a\\x00b\\x7f\\x9fc"
    assert wire.guest_text("x\ud800y\udfff") == "x\\ud800y\\udfff"
    assert wire.guest_text("tab\tnew\nline é ✓") == "tab\tnew\nline é ✓"


def test_a_refused_name_says_what_and_shows_it_escaped_and_cut() -> None:
    """Protects the refusal an operator reads: it names what was refused (``artifact name``
    unless told) and shows the name escaped, whole up to ``MAX_NAME`` characters, then cut."""
    with pytest.raises(UnsafePath, match=r"^secret file a/\\x00b has a control character"):
        wire.guest_name("a/\x00b", "secret file")
    with pytest.raises(UnsafePath, match=r"^artifact name a\\x01 has a control character"):
        wire.guest_name("a\x01")
    with pytest.raises(UnsafePath) as refused:
        wire.guest_name("\x01" + "x" * (3 * protocol.MAX_NAME))
    shown = str(refused.value).removeprefix("artifact name ").split(" has ")[0]
    assert shown.endswith("…") and len(shown) == protocol.MAX_NAME + 1


def test_guest_text_marks_a_cut_and_only_a_cut() -> None:
    """``…`` says the guest's text was cut (by length, or by escapes that made it longer);
    text of exactly ``limit`` characters is whole."""
    assert wire.guest_text("a" * 10, 10) == "a" * 10
    assert wire.guest_text("a" * 11, 10) == "a" * 10 + "…"
    assert wire.guest_text("\x01" * 3, 10) == "\\x01\\x01\\x…"


def test_an_empty_frame_header_is_an_empty_object() -> None:
    assert wire.decode_header(b"") == {}


class Guest:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def raw(self, kind: int, header: bytes, body: bytes = b"") -> None:
        self.sock.sendall(protocol.PREFIX.pack(b"CR", kind, len(header), len(body)) + header + body)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[AgentConnection, Guest]]:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock, limit=1 << 22)
    session = AgentConnection(reader, writer)
    yield session, Guest(guest_sock)
    await session.aclose()
    guest_sock.close()


async def _send_later(guest: Guest, kind: int, header: bytes, body: bytes = b"") -> None:
    await asyncio.to_thread(guest.raw, kind, header, body)


@pytest.mark.parametrize(
    "header",
    [
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"agent_version": NaN}',
        b'{"t": 1e999}',
        b'{"x\\ud800": 1}',
        b"[1]",
        b"\xff\xfe",
    ],
)
async def test_hostile_headers_are_protocol_errors(
    pair: tuple[AgentConnection, Guest], header: bytes
) -> None:
    session, guest = pair
    sender = asyncio.create_task(_send_later(guest, Kind.HELLO, header))
    with pytest.raises(ProtocolError):
        await session.wait_hello()
    await sender


async def test_header_size_limit_at_its_edge(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    head = b'{"pad": "'
    fits = head + b"x" * (protocol.MAX_HEADER - len(head) - 2) + b'"}'
    sender = asyncio.create_task(_send_later(guest, Kind.HELLO, fits))
    assert len((await session.wait_hello())["pad"]) == protocol.MAX_HEADER - len(head) - 2
    await sender
    over = fits[:-2] + b'x"}'
    guest.sock.sendall(protocol.PREFIX.pack(b"CR", Kind.HELLO, len(over), 0))
    with pytest.raises(FrameTooLarge):
        await session.wait_hello()


async def test_body_size_limit_at_its_edge(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    sender = asyncio.create_task(
        _send_later(guest, Kind.PONG, b"{}", b"x" * protocol.DEFAULT_MAX_BODY)
    )
    assert await session.ping() >= 0
    await sender
    guest.raw(Kind.PONG, b"{}", b"x")  # the prefix is refused before the body is read
    guest.sock.sendall(protocol.PREFIX.pack(b"CR", Kind.PONG, 2, protocol.DEFAULT_MAX_BODY + 1))
    assert await session.ping() >= 0
    with pytest.raises(FrameTooLarge):
        await session.ping()


async def test_a_guest_error_message_is_kept_short_and_printable(
    pair: tuple[AgentConnection, Guest],
) -> None:
    session, guest = pair
    guest.sock.sendall(encode(Kind.ERROR, {"message": "\x1b]0;pwn\x07" + "m" * 10_000}))
    with pytest.raises(ProtocolError) as caught:
        await session.wait_hello()
    assert len(str(caught.value)) < protocol.MAX_MESSAGE + 100
    assert "\x1b" not in str(caught.value) and "\x07" not in str(caught.value)


@pytest.mark.parametrize("name", ["x\ud800y", "d/" + "x" * 300, "a\nb"])
async def test_hostile_artifact_names_end_as_unsafe_path_inside_staging(
    pair: tuple[AgentConnection, Guest], tmp_path: Path, name: str
) -> None:
    """The lone surrogate raised UnicodeEncodeError at os.open (it crashed the controller), the
    300-byte component ENAMETOOLONG (infra_error); both are the guest's error now."""
    session, guest = pair
    staging = tmp_path / "staging"
    header = {"name": name, "offset": 0, "eof": True, "kind": "artifact"}
    guest.sock.sendall(encode(Kind.FILE, header, b"x"))
    with pytest.raises(ProtocolError):  # UnsafePath, or the header's own lone surrogate
        await session.run_episode({"manifest": {}}, staging, quota_bytes=1000)
    assert [p for p in tmp_path.rglob("*") if staging not in p.parents and p != staging] == []


@pytest.mark.parametrize("raw", [nested(100_000), b'{"pass": true, "details": {"x": NaN}}'])
def test_a_verifiers_verdict_crosses_the_same_boundary(raw: bytes) -> None:
    """A verifier runs in a guest too: a deep or NaN verdict.json raised RecursionError (or
    reached export) before; now it is the VerifierError the verifier path handles."""
    from cleanroom.errors import VerifierError
    from cleanroom.lifecycle.verify import parse_verdict

    with pytest.raises(VerifierError):
        parse_verdict(raw)


@pytest.mark.parametrize("kind", ["object", "array"])
def test_nesting_up_to_the_depth_limit_is_accepted_one_more_refused(kind: str) -> None:
    """``max_depth`` is exact for objects and arrays alike: ``depth`` containers pass,
    ``depth + 1`` is a ProtocolError naming the document (an off-by-one lets a guest nest one
    level deeper than the limit docs/manifests.md states, or refuses an honest document)."""
    limits = wire.JsonLimits(max_bytes=1 << 20, max_depth=5)

    def nested(depth: int) -> bytes:
        opened, closed = ('{"k":', "}") if kind == "object" else ("[", "]")
        return (opened * depth + "1" + closed * depth).encode()

    assert wire.decode_json(nested(5), limits, "doc") is not None
    with pytest.raises(ProtocolError, match=r"^doc nests deeper than 5$"):
        wire.decode_json(nested(6), limits, "doc")


def test_header_errors_say_it_was_the_frame_header() -> None:
    """A guest's bad header is reported as the frame header (not some other document)."""
    with pytest.raises(ProtocolError, match=r"^frame header is not a JSON object$"):
        wire.decode_header(b"[1]")
    with pytest.raises(ProtocolError, match=r"^frame header is not valid JSON"):
        wire.decode_header(b"{nope")
    with pytest.raises(ProtocolError, match=r"^frame header has a string with a lone surrogate$"):
        wire.decode_header(b'{"a": "\\ud800"}')
    with pytest.raises(ProtocolError, match=r"^frame header is not valid JSON.*1e999 overflows"):
        wire.decode_header(b'{"a": 1e999}')
    with pytest.raises(ProtocolError, match=r"^frame header is not valid JSON.*NaN is not allowed"):
        wire.decode_header(b'{"a": NaN}')
    with pytest.raises(ProtocolError, match=r"integer of 22 digits is out of range"):
        wire.decode_header(b'{"a": ' + b"9" * 22 + b"}")

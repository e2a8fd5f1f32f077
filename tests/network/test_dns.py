"""The DNS wire format the egress proxy speaks (queries in, answers out)."""

from __future__ import annotations

import socket
import struct

import pytest

from cleanroom.network import dns


def query(name: str, qtype: int = 1, qid: int = 0x1234, flags: int = 0x0100) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".") if p)
    return (
        struct.pack("!HHHHHH", qid, flags, 1, 0, 0, 0)
        + labels
        + b"\0"
        + struct.pack("!HH", qtype, 1)
    )


def test_a_query_parses_and_gets_an_a_record() -> None:
    q = dns.parse_query(query("Allowed.Test", qid=7))
    assert (q.id, q.name, q.qtype, q.type_name) == (7, "allowed.test", 1, "A")
    answer = dns.response(q, dns.NOERROR, "10.0.2.128")
    qid, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", answer)
    assert (qid, qd, an, ns, ar) == (7, 1, 1, 0, 0)
    assert flags & 0x8000 and flags & 0x0100 and flags & 0xF == dns.NOERROR  # QR, RD kept
    assert answer[12 : 12 + len(q.question)] == q.question
    assert answer.endswith(socket.inet_aton("10.0.2.128"))
    rtype, rclass, ttl, rdlen = struct.unpack_from("!HHIH", answer, 12 + len(q.question) + 2)
    assert (rtype, rclass, ttl, rdlen) == (1, 1, dns.TTL_S, 4)


def test_nxdomain_and_nodata_carry_no_answer() -> None:
    q = dns.parse_query(query("evil.test", qtype=28))
    assert q.type_name == "AAAA"
    for rcode in (dns.NXDOMAIN, dns.NOERROR):
        answer = dns.response(q, rcode)
        _, flags, _, an, _, _ = struct.unpack_from("!HHHHHH", answer)
        assert flags & 0xF == rcode and an == 0


@pytest.mark.parametrize(
    ("message", "rcode"),
    [
        (b"\x00\x01", dns.FORMERR),  # shorter than a header
        (query("a.test", flags=0x8100), dns.FORMERR),  # a response
        (query("a.test", flags=0x2900), dns.NOTIMP),  # opcode 5 (UPDATE)
        (struct.pack("!HHHHHH", 1, 0x100, 2, 0, 0, 0) + b"\0\0\1\0\1" * 2, dns.FORMERR),
        (struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\xc0\x0c\0\1\0\1", dns.FORMERR),
        (query("a.test")[:-3], dns.FORMERR),  # truncated question
    ],
)
def test_malformed_queries_are_refused_with_a_code(message: bytes, rcode: int) -> None:
    with pytest.raises(dns.BadQuery) as info:
        dns.parse_query(message)
    assert info.value.rcode == rcode
    answer = dns.error_response(info.value)
    assert len(answer) == 12 and answer[3] & 0xF == rcode and answer[2] & 0x80


def test_odd_bytes_in_a_name_are_escaped_not_trusted() -> None:
    raw = struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\x03a\x00b\x04test\x00\x00\x01\x00\x01"
    q = dns.parse_query(raw)
    assert q.name == "a\\000b.test"

"""The little of the DNS wire format the egress proxy needs: read a query, write an answer.

Only standard queries with one question are answered; anything else gets FORMERR (malformed)
or NOTIMP (another opcode). Answers carry at most one A record and no EDNS.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
TYPE_A = 1
TYPES = {1: "A", 28: "AAAA", 5: "CNAME", 12: "PTR", 15: "MX", 16: "TXT", 33: "SRV", 65: "HTTPS"}
MAX_MESSAGE = 4096
TTL_S = 30


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    name: str  # lower-case, no trailing dot; labels that are not LDH are escaped
    qtype: int
    qclass: int
    question: bytes  # the question section as sent (echoed in the answer)

    @property
    def type_name(self) -> str:
        return TYPES.get(self.qtype, f"TYPE{self.qtype}")


class BadQuery(ValueError):
    """Not a standard one-question query; ``rcode`` says what to answer, ``id`` to whom."""

    def __init__(self, message: str, query_id: int, flags: int, rcode: int) -> None:
        super().__init__(message)
        self.id, self.flags, self.rcode = query_id, flags, rcode


def parse_query(data: bytes) -> Query:
    """Parse a query message; BadQuery if it is not one we answer."""
    if len(data) < 12:
        raise BadQuery("shorter than a DNS header", 0, 0, FORMERR)
    qid, flags, qdcount = struct.unpack_from("!HHH", data)
    if flags & 0x8000:
        raise BadQuery("a response, not a query", qid, flags, FORMERR)
    if (flags >> 11) & 0xF:
        raise BadQuery("not a standard query", qid, flags, NOTIMP)
    if qdcount != 1:
        raise BadQuery(f"{qdcount} questions", qid, flags, FORMERR)
    labels, offset = [], 12
    while True:
        if offset >= len(data):
            raise BadQuery("truncated name", qid, flags, FORMERR)
        length = data[offset]
        offset += 1
        if length == 0:
            break
        if length > 63 or offset + length > len(data):
            raise BadQuery("bad label (no compression in a question)", qid, flags, FORMERR)
        labels.append(data[offset : offset + length])
        offset += length
    if offset + 4 > len(data):
        raise BadQuery("truncated question", qid, flags, FORMERR)
    qtype, qclass = struct.unpack_from("!HH", data, offset)
    name = ".".join(_label(raw) for raw in labels)
    return Query(qid, flags, name, qtype, qclass, data[12 : offset + 4])


def _label(raw: bytes) -> str:
    text = raw.decode("ascii", "backslashreplace").lower()
    return "".join(c if c.isalnum() or c in "-_" else f"\\{ord(c):03d}" for c in text)


def response(query: Query, rcode: int, address: str | None = None) -> bytes:
    """The answer to ``query``: ``rcode``, with one A record for ``address`` if given."""
    flags = 0x8000 | 0x0400 | (query.flags & 0x0100) | 0x0080 | rcode  # QR AA RD RA
    answer = b""
    if address is not None:
        rdata = socket.inet_aton(address)
        answer = struct.pack("!HHHIH", 0xC00C, TYPE_A, 1, TTL_S, len(rdata)) + rdata
    header = struct.pack("!HHHHHH", query.id, flags, 1, 1 if answer else 0, 0, 0)
    return header + query.question + answer


def error_response(bad: BadQuery) -> bytes:
    """A header-only answer to a query we could not parse."""
    flags = 0x8000 | (bad.flags & 0x7900) | 0x0080 | bad.rcode
    return struct.pack("!HHHHHH", bad.id, flags, 0, 0, 0, 0)

"""What the egress proxy records: one ``NetEvent`` per connection or DNS query."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class NetEvent:
    """One connection or DNS query, as the proxy saw it."""

    via: str  # "connect" (HTTP CONNECT), "http" (absolute-form request), "tcp", "dns"
    dest: str  # "host:port", or "name TYPE" for DNS
    allowed: bool
    reason: str
    started: float  # unix time
    duration_s: float
    bytes_up: int  # guest -> destination
    bytes_down: int  # destination -> guest
    rule: str | None = None  # the allowlist entry that allowed it
    address: str | None = None  # what the host connected to, or the DNS answer
    error: str | None = None  # an allowed connection that failed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Flow:
    """A connection or query being served; ``event()`` freezes what happened."""

    def __init__(self, via: str, dest: str = "") -> None:
        self.via, self.dest = via, dest
        self.started, self._t0 = time.time(), time.monotonic()
        self.allowed, self.reason = False, "closed before a request"
        self.rule: str | None = None
        self.address: str | None = None
        self.error: str | None = None
        self.up = self.down = 0

    def event(self) -> NetEvent:
        duration = round(time.monotonic() - self._t0, 6)
        return NetEvent(
            self.via,
            self.dest,
            self.allowed,
            self.reason,
            self.started,
            duration,
            self.up,
            self.down,
            self.rule,
            self.address,
            self.error,
        )

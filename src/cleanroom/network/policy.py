"""Egress allowlists: parse entries, match destinations, narrow a baseline's policy.

An entry is ``HOST:PORT``. HOST is an exact DNS name (``api.example.com``), a wildcard
(``*.example.com``: any name strictly below example.com, not example.com itself), an IP address
(``10.1.2.3``, ``[fd00::1]``) or a CIDR network (``10.0.0.0/8``, ``[fd00::/8]``); PORT is
1-65535. Names match names and addresses match addresses: a name is never resolved to be
matched against an address entry, nor an address against a name entry.

A baseline's ``network.allow`` is the most an episode may get; a manifest's ``network.allow``
may only narrow it (each entry covered by one of the baseline's: the same port, and the same
name, a name below a wildcard, a narrower wildcard, or an address/network inside a network).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cleanroom.errors import NetworkPolicyError

MAX_RULES = 256
LABEL_RE = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)\Z")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def normalize_name(name: str) -> str | None:
    """A DNS name lowercased without its trailing dot, or None if it is not a valid name.

    A name whose last label is all digits (``127.1``, ``2130706433``) is refused: resolvers
    read such strings as addresses.
    """
    name = name.lower().removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(LABEL_RE.match(label) for label in labels):
        return None
    return None if labels[-1].isdigit() else name


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); ValueError if malformed."""
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
        if not sep:
            raise ValueError("expected [ADDRESS]:PORT")
    else:
        host, sep, port = target.rpartition(":")
        if not sep or ":" in host:
            raise ValueError("expected HOST:PORT (IPv6 in brackets: [ADDRESS]:PORT)")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port!r} is not a number in 1-65535")
    if not host:
        raise ValueError("empty host")
    return host, int(port)


@dataclass(frozen=True)
class Rule:
    """One allowlist entry. ``host``: the name, the wildcard's suffix, or the network."""

    kind: Literal["name", "wildcard", "net"]
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Rule:
        """Parse one entry; ValueError says what is wrong with it."""
        host, port = split_target(text.strip())
        if host.startswith("*."):
            suffix = normalize_name(host[2:])
            if suffix is None:
                raise ValueError(f"{host!r} is not a wildcard of a DNS name")
            return cls("wildcard", suffix, port)
        try:
            return cls("net", str(ipaddress.ip_network(host, strict=True)), port)
        except ValueError as exc:
            if "/" in host or host.replace(".", "").isdigit() or ":" in host:
                raise ValueError(f"{host!r} is not an address or network: {exc}") from exc
        name = normalize_name(host)
        if name is None:
            raise ValueError(f"{host!r} is not a DNS name, wildcard, address or network")
        return cls("name", name, port)

    @property
    def network(self) -> IPNetwork:
        return ipaddress.ip_network(self.host)

    def __str__(self) -> str:
        host = f"*.{self.host}" if self.kind == "wildcard" else self.host
        if self.kind == "net":
            net = self.network
            host = str(net.network_address) if net.num_addresses == 1 else str(net)
            host = f"[{host}]" if net.version == 6 else host
        return f"{host}:{self.port}"

    def matches(self, host: str, port: int) -> bool:
        """Does this rule allow ``host`` (a normalized name or an address) on ``port``?"""
        if port != self.port:
            return False
        if self.kind == "net":
            address = as_address(host)
            return address is not None and address in self.network
        if as_address(host) is not None:
            return False
        if self.kind == "name":
            return host == self.host
        return host.endswith("." + self.host)

    def covers(self, other: Rule) -> bool:
        """Does this rule allow everything ``other`` allows?"""
        if other.port != self.port:
            return False
        if self.kind == "net" or other.kind == "net":
            return self.kind == other.kind and _subnet(other.network, self.network)
        if self.kind == "name":
            return other.kind == "name" and other.host == self.host
        below = other.host.endswith("." + self.host)
        return below or (other.kind == "wildcard" and other.host == self.host)


def _subnet(inner: IPNetwork, outer: IPNetwork) -> bool:
    if isinstance(inner, ipaddress.IPv4Network) and isinstance(outer, ipaddress.IPv4Network):
        return inner.subnet_of(outer)
    if isinstance(inner, ipaddress.IPv6Network) and isinstance(outer, ipaddress.IPv6Network):
        return inner.subnet_of(outer)
    return False


def as_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True)
class Policy:
    """An egress allowlist (empty: no network)."""

    rules: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str], where: str = "allow") -> Policy:
        """Parse entries; one NetworkPolicyError lists every bad one. Duplicates are dropped."""
        rules: list[Rule] = []
        problems = []
        for index, text in enumerate(entries):
            try:
                rule = Rule.parse(text)
            except ValueError as exc:
                problems.append(f"{where}[{index}] {text!r}: {exc}")
                continue
            if rule not in rules:
                rules.append(rule)
        if len(rules) > MAX_RULES:
            problems.append(f"{where}: more than {MAX_RULES} entries")
        if problems:
            raise NetworkPolicyError("invalid egress allowlist", problems)
        return cls(tuple(rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def entries(self) -> list[str]:
        return [str(rule) for rule in self.rules]

    def match(self, host: str, port: int) -> Rule | None:
        """The first rule allowing ``host:port`` (host: a name or an address), or None."""
        address = as_address(host.strip("[]"))
        key = str(address) if address is not None else normalize_name(host)
        if key is None:
            return None
        return next((rule for rule in self.rules if rule.matches(key, port)), None)

    def narrowed(self, requested: Iterable[str] | None, who: str = "the manifest") -> Policy:
        """The policy ``who`` asks for, if this one covers every entry of it.

        ``None`` (nothing asked) keeps this policy; an entry this policy does not cover, or any
        entry when this policy is empty, is a NetworkPolicyError naming it.
        """
        if requested is None:
            return self
        wanted = Policy.parse(requested)
        if wanted and not self:
            raise NetworkPolicyError(
                f"{who} asks for network {wanted.entries()}, but its baseline allows none"
            )
        wider = [str(r) for r in wanted.rules if not any(b.covers(r) for b in self.rules)]
        if wider:
            raise NetworkPolicyError(
                f"{who} asks for network its baseline does not allow: {', '.join(wider)} "
                f"(the baseline allows {', '.join(self.entries())}); a manifest may only narrow it"
            )
        return wanted


def checked_allowlist(entries: list[str]) -> list[str]:
    """``entries`` unchanged if every one parses; else ValueError naming each bad one (for
    pydantic validators: the baseline spec's and the manifest's ``network.allow``)."""
    try:
        Policy.parse(entries)
    except NetworkPolicyError as exc:
        raise ValueError("; ".join(exc.problems)) from exc
    return entries

"""The guest's side of one env's egress: which guest address:port leads where.

The VM's user-mode network (QEMU's default 10.0.2.0/24 layout, ``restrict=on``) routes nothing
out; the guest reaches only the forwards of its plan, each handed by QEMU to the env's egress
proxy with its tag:

- ``proxy``: the HTTP proxy at PROXY_ADDR:PROXY_PORT (CONNECT, absolute-form ``http://``);
- ``dns``: DNS over TCP at DNS_ADDR:53 (the guest's resolv.conf says ``options use-vc``);
- ``tcp-N``: plain TCP. Each exact name of the allowlist gets a synthetic address
  (10.0.2.128 upwards, at most 127 names) with a forward on each of its allowed ports; the
  proxy's DNS answers the name with that address, and a connection to it goes to the name.

Wildcards, addresses and networks get no synthetic address: they are reachable through the
HTTP proxy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cleanroom.agent import guestnet
from cleanroom.network.policy import Policy

PREFIX = guestnet.NETWORK.rsplit(".", 1)[0]  # "10.0.2"
MAX_NAMES = guestnet.SYNTHETIC_LAST - guestnet.SYNTHETIC_FIRST + 1


@dataclass(frozen=True)
class Forward:
    """One guest address:port QEMU hands to the proxy; ``dest`` for plain TCP forwards."""

    tag: str
    guest_addr: str
    guest_port: int
    dest: tuple[str, int] | None = None


@dataclass(frozen=True)
class Plan:
    forwards: tuple[Forward, ...]
    addresses: dict[str, str] = field(default_factory=dict)  # exact name -> synthetic address
    connect_only: tuple[str, ...] = ()  # exact names beyond MAX_NAMES

    def forward(self, tag: str) -> Forward | None:
        return next((f for f in self.forwards if f.tag == tag), None)


def plan_for(policy: Policy) -> Plan:
    """The forwards of a (non-empty) policy."""
    forwards = [
        Forward("proxy", guestnet.PROXY_ADDR, guestnet.PROXY_PORT),
        Forward("dns", guestnet.DNS_ADDR, guestnet.DNS_PORT),
    ]
    addresses: dict[str, str] = {}
    overflow: list[str] = []
    for rule in policy.rules:
        if rule.kind != "name":
            continue
        if rule.host not in addresses:
            if len(addresses) == MAX_NAMES:
                overflow.append(rule.host)
                continue
            addresses[rule.host] = f"{PREFIX}.{guestnet.SYNTHETIC_FIRST + len(addresses)}"
        tag = f"tcp-{len(forwards) - 2}"
        forwards.append(Forward(tag, addresses[rule.host], rule.port, (rule.host, rule.port)))
    return Plan(tuple(forwards), addresses, tuple(dict.fromkeys(overflow)))

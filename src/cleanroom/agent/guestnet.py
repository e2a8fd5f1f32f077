"""The guest's fixed network layout, which the host's egress forwards expect.

A VM gets a NIC only when its episode has an egress allowlist (the qemu driver's user-mode
network, ``restrict=on``: its only ways out are forwards to the host's egress proxy). The layout
is fixed, so the guest needs no per-env configuration: the native agent (``native/net.c``, which
restates these constants) gives ``eth0`` GUEST_ADDR/24 with a default route via GATEWAY, brings
``lo`` up, points ``/etc/resolv.conf`` at DNS_ADDR with ``options use-vc`` (DNS over TCP: the
forward is TCP only) and gives every process it starts the proxy variables (``proxy_env``).
"""

from __future__ import annotations

IFACE = "eth0"
NETWORK = "10.0.2.0"
NETMASK = "255.255.255.0"
GUEST_ADDR = "10.0.2.15"
GATEWAY = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"  # QEMU's own DNS relay: unreachable under restrict=on, never used
PROXY_ADDR = "10.0.2.100"
PROXY_PORT = 3128
DNS_ADDR = "10.0.2.101"
DNS_PORT = 53  # resolv.conf cannot name a port
SYNTHETIC_FIRST = 128  # 10.0.2.128 .. 10.0.2.254: one address per allowed exact name
SYNTHETIC_LAST = 254


def proxy_env() -> dict[str, str]:
    """What a process needs to use the egress proxy (curl reads only the lower-case names)."""
    url = f"http://{PROXY_ADDR}:{PROXY_PORT}"
    env = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "NO_PROXY": "localhost,127.0.0.1"}
    env.update({k.lower(): v for k, v in env.items()})
    return env

"""Guest network setup (standard library only): used by the agent when the VM has a NIC.

A VM gets a NIC only when its episode has an egress allowlist (the qemu driver's user-mode
network, ``restrict=on``: its only ways out are forwards to the host's egress proxy). The layout
is fixed, so the guest needs no per-env configuration: ``setup()`` gives ``eth0`` GUEST_ADDR/24
with a default route via GATEWAY, brings ``lo`` up, points ``/etc/resolv.conf`` at DNS_ADDR with
``options use-vc`` (DNS over TCP: the forward is TCP only) and returns the proxy variables for
every process the agent starts. Without a NIC (or outside a VM) it does nothing.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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

SIOCADDRT = 0x890B
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFADDR = 0x8916
SIOCSIFNETMASK = 0x891C
IFF_UP = 0x1
RTF_UP = 0x1
RTF_GATEWAY = 0x2


def proxy_env() -> dict[str, str]:
    """What a process needs to use the egress proxy (curl reads only the lower-case names)."""
    url = f"http://{PROXY_ADDR}:{PROXY_PORT}"
    env = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "NO_PROXY": "localhost,127.0.0.1"}
    env.update({k.lower(): v for k, v in env.items()})
    return env


def setup() -> dict[str, Any]:
    """Configure the NIC if there is one: ``{"address", "env"}``, ``{"error"}``, or ``{}``."""
    if os.environ.get("CLEANROOM_AGENT_SOCKET") or not os.path.isdir(f"/sys/class/net/{IFACE}"):
        return {}
    try:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            _up(sock, "lo")
            _set_address(sock, IFACE, SIOCSIFADDR, GUEST_ADDR)
            _set_address(sock, IFACE, SIOCSIFNETMASK, NETMASK)
            _up(sock, IFACE)
            _default_route(sock, GATEWAY)
        _write("/etc/resolv.conf", f"nameserver {DNS_ADDR}\noptions use-vc timeout:5 attempts:2\n")
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"address": GUEST_ADDR, "env": proxy_env()}


def _sockaddr(address: str) -> bytes:
    import socket
    import struct

    return struct.pack("<H2x4s8x", socket.AF_INET, socket.inet_aton(address))  # sockaddr_in


def _ifreq(name: str, payload: bytes) -> bytes:
    return name.encode().ljust(16, b"\0") + payload.ljust(24, b"\0")


def _set_address(sock: Any, name: str, request: int, address: str) -> None:
    import fcntl

    fcntl.ioctl(sock, request, _ifreq(name, _sockaddr(address)))


def _up(sock: Any, name: str) -> None:
    import fcntl
    import struct

    flags = struct.unpack_from("<H", fcntl.ioctl(sock, SIOCGIFFLAGS, _ifreq(name, b"")), 16)[0]
    fcntl.ioctl(sock, SIOCSIFFLAGS, _ifreq(name, struct.pack("<H", flags | IFF_UP)))


def _default_route(sock: Any, gateway: str) -> None:
    """``route add default gw GATEWAY`` (struct rtentry, x86_64 layout, 120 bytes)."""
    import fcntl
    import struct

    entry = struct.pack(
        "@L16s16s16sHhLPhPLLH",
        0,
        _sockaddr("0.0.0.0"),  # rt_dst
        _sockaddr(gateway),  # rt_gateway
        _sockaddr("0.0.0.0"),  # rt_genmask
        RTF_UP | RTF_GATEWAY,
        *(0,) * 8,
    )
    fcntl.ioctl(sock, SIOCADDRT, entry.ljust(120, b"\0"))


def _write(path: str, text: str) -> None:
    tmp = path + ".cleanroom"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # replaces a symlink too (the root is a writable overlay)

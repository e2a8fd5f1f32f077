"""QEMU arguments of a networked env: a restricted user-mode network whose only exits are
forwards to the env's egress proxy.

``-netdev user,restrict=on`` (libslirp) drops every guest packet that is not DHCP or a
``guestfwd`` address:port, IPv6 is off, and there is no ``hostfwd`` (nothing comes in). Each
``guestfwd`` runs ``fdpass.py`` for every guest connection: it hands the connection to the
proxy's unix socket with the forward's tag and exits. libslirp starts that helper with
``fork``/``exec`` and ``setsid`` in the child, so a networked VM's QEMU runs with ``-sandbox``
``spawn`` and ``elevateprivileges`` allowed (every other VM keeps them denied).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from cleanroom.agent import guestnet
from cleanroom.network.plan import Forward

FDPASS = Path(__file__).resolve().parent / "fdpass.py"
NETDEV_ID = "egress"
SANDBOX_NETWORKED = "on,obsolete=deny,elevateprivileges=allow,spawn=allow,resourcecontrol=deny"


@dataclass(frozen=True)
class Attachment:
    """What a driver needs to attach a VM to its egress proxy.

    ``socket``: the proxy's abstract unix socket name (no leading NUL); it carries the env's
    marker, so a helper still running is found (and killed) with the env.
    """

    socket: str
    forwards: tuple[Forward, ...]


def _opt(value: str) -> str:
    return value.replace(",", ",,")


def helper_command(socket: str, tag: str) -> str:
    """The command line QEMU runs per guest connection to a forward (shell-quoted)."""
    argv = [sys.executable, "-I", "-S", str(FDPASS), socket, tag]
    return " ".join(shlex.quote(a) for a in argv)


def netdev_args(attachment: Attachment) -> list[str]:
    """``-netdev user,...`` with one ``guestfwd`` per forward, and the VM's virtio NIC."""
    netdev = [
        f"user,id={NETDEV_ID},restrict=on,ipv4=on,ipv6=off",
        f"net={guestnet.NETWORK}/24,host={guestnet.GATEWAY},dns={guestnet.SLIRP_DNS}",
        f"dhcpstart={guestnet.GUEST_ADDR}",
    ]
    for fwd in attachment.forwards:
        command = helper_command(attachment.socket, fwd.tag)
        netdev.append(f"guestfwd=tcp:{fwd.guest_addr}:{fwd.guest_port}-cmd:{_opt(command)}")
    return ["-netdev", ",".join(netdev), "-device", f"virtio-net-device,netdev={NETDEV_ID}"]

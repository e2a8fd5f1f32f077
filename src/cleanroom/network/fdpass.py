"""Run by QEMU's user network for each guest connection to a forward (standard library only).

``python3 -I -S fdpass.py SOCKET TAG``: stdin is the guest connection. Hand it to the egress
proxy listening on the abstract unix socket SOCKET (SCM_RIGHTS, with TAG naming the forward),
then exit: the proxy serves the connection from here on. If the proxy is gone, exit 1 (QEMU
then closes the guest's connection).
"""

import socket
import sys


def main() -> int:
    name, tag = sys.argv[1], sys.argv[2]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + name)
            socket.send_fds(sock, [tag.encode()], [0])
            sock.recv(1)  # the proxy's ack: it holds the connection now
    except OSError as exc:
        print(f"cleanroom egress helper: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

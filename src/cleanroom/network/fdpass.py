"""Run by QEMU's user network for each guest connection to a forward (standard library only).

``python3 -I -S fdpass.py SOCKET TAG``: stdin is the guest connection. Hand it to the egress
proxy listening on the abstract unix socket SOCKET (SCM_RIGHTS, with TAG naming the forward),
then exit: the proxy serves the connection from here on. If the proxy is gone, or closes
without its ack (it refused the hand-off: another user's helper), say so on stderr and exit 1
(QEMU then closes the guest's connection). Only the C ``_socket`` module is imported: ``socket``
would cost ~25 ms more per connection.
"""

import _socket
import sys


def main() -> int:
    name, tag = sys.argv[1], sys.argv[2]
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect("\0" + name)
        fd = (0).to_bytes(4, sys.byteorder)  # an int[1] of stdin's descriptor
        try:
            sock.sendmsg([tag.encode()], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd)])
            ack = sock.recv(1)  # the proxy's ack: it holds the connection now
        except (BrokenPipeError, ConnectionResetError):
            ack = b""  # the proxy hung up on us: refused as well
    except OSError as exc:
        print(f"cleanroom egress helper: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    if ack != b"k":
        print("cleanroom egress helper: the proxy refused the hand-off", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A WebSocket echo server in the standard library only (it runs in a guest that has python3 and
nothing else): ``python3 wsecho.py PORT``. One thread per connection; text and binary
messages come back as they went; a close is answered. Test data, not a product."""

import base64
import hashlib
import socket
import struct
import sys
import threading

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def read_exact(conn, n):
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def frame(opcode, payload):
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack(">H", n)
    else:
        head += bytes([127]) + struct.pack(">Q", n)
    return head + payload


def serve(conn):
    request = b""
    while b"\r\n\r\n" not in request:
        part = conn.recv(4096)
        if not part:
            return
        request += part
    key = b""
    for line in request.split(b"\r\n"):
        if line.lower().startswith(b"sec-websocket-key:"):
            key = line.split(b":", 1)[1].strip()
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    conn.sendall(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )
    try:
        while True:
            b1, b2 = read_exact(conn, 2)
            opcode, n = b1 & 0x0F, b2 & 0x7F
            if n == 126:
                n = struct.unpack(">H", read_exact(conn, 2))[0]
            elif n == 127:
                n = struct.unpack(">Q", read_exact(conn, 8))[0]
            mask = read_exact(conn, 4) if b2 & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(read_exact(conn, n)))
            if opcode == 8:
                conn.sendall(frame(8, data[:2]))
                return
            if opcode == 9:
                conn.sendall(frame(10, data))
            elif opcode in (1, 2):
                conn.sendall(frame(opcode, data))
    except EOFError:
        pass
    finally:
        conn.close()


def main():
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", int(sys.argv[1])))
    srv.listen(16)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()

"""Entrypoint of the ``hostile`` test baseline: a guest that attacks the host's parsers.

Acts on ``manifest["task"]["mode"]`` (standard library only):

- ``deep-result``: a result.json nested 100,000 deep.
- ``nan-metrics``: a valid reward, but ``1e999`` in ``info`` and ``NaN`` in ``metrics``.
- ``surrogate-name``: an artifact whose file name is not UTF-8 (the agent sends it as a lone
  surrogate, ``"x\\udcffy"``).
- ``long-name``: a FILE frame naming a 300-character component, written into the agent's
  control port (no file system can hold that name).
- ``deep-header``: a frame whose header is nested 100,000 deep, written into the port.
- ``big-result``: a valid result.json of ``task["bytes"]`` bytes (default 2 MiB).
- ``flood-console``: writes to the serial console without end (``task["seconds"]``, default
  120) and nothing else: its output quota must end it.
- ``hide-secret``: the secret ``task["secret"]`` as ``\\uXXXX`` escapes in result.json (key and
  value), as an artifact's name, and base64-encoded and URL-encoded in stdout.
"""

import base64
import json
import os
import sys
import time

ROOT = os.environ.get("CLEANROOM_DIR", "/run/cleanroom")


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def control_port():
    """The agent's channel, taken with pidfd_getfd (as any root process in the guest can)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    agent = os.getppid()
    for fd in os.listdir(f"/proc/{agent}/fd"):
        if os.readlink(f"/proc/{agent}/fd/{fd}").startswith("/dev/vport"):
            pidfd = libc.syscall(434, agent, 0)  # pidfd_open
            stolen = libc.syscall(438, pidfd, int(fd), 0)  # pidfd_getfd
            if pidfd < 0 or stolen < 0:
                raise OSError(ctypes.get_errno(), "pidfd_getfd failed")
            return os.fdopen(stolen, "wb", buffering=0)
    raise RuntimeError("no control port")


def send(data):
    """Write all of ``data`` into the agent's port (a raw write may take only part of it)."""
    port = control_port()
    view = memoryview(data)
    while view:
        view = view[port.write(view) :]


def frame(kind, header, body=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    sizes = len(raw).to_bytes(4, "big") + len(body).to_bytes(4, "big")
    return b"CR" + bytes([kind]) + sizes + raw + body


def escaped(text):
    return "".join(f"\\u{ord(c):04x}" for c in text)


def main():
    with open(ROOT + "/manifest.json") as f:
        task = json.load(f).get("task") or {}
    mode = task.get("mode")
    os.makedirs(ROOT + "/out", exist_ok=True)
    result = ROOT + "/result.json"
    if mode == "deep-result":
        write(result, b'{"reward": 1, "info": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    elif mode == "nan-metrics":
        write(result, b'{"reward": 1, "info": {"x": 1e999}, "metrics": {"m": NaN}}')
    elif mode == "surrogate-name":
        write(ROOT.encode() + b"/out/x\xffy", b"bytes")
        write(result, b'{"reward": 1}')
    elif mode == "long-name":
        header = {"name": "x" * 300, "offset": 0, "eof": True, "kind": "artifact"}
        send(frame(8, header, b"x"))
        time.sleep(60)
    elif mode == "deep-header":
        send(frame(6, b"[" * 100_000 + b"]" * 100_000))
        time.sleep(60)
    elif mode == "big-result":
        size = int(task.get("bytes", 2 << 20))
        head = b'{"reward": 1, "pad": "'
        write(result, head + b"x" * (size - len(head) - 2) + b'"}')
    elif mode == "flood-console":
        end = time.monotonic() + float(task.get("seconds", 120))
        with open("/dev/console", "wb", buffering=0) as console:
            while time.monotonic() < end:
                console.write(b"flooding the console " * 200)
        write(result, b'{"reward": 1}')
    elif mode == "hide-secret":
        value = os.environ[task["secret"]]
        print("b64 " + base64.b64encode(value.encode()).decode(), flush=True)
        print("url " + "".join(f"%{b:02X}" for b in value.encode()), flush=True)
        named = ROOT + "/out/" + value + ".txt"  # a "/" in the value makes folders
        os.makedirs(os.path.dirname(named), exist_ok=True)
        write(named, b"named after the secret\n")
        key = escaped(value)
        write(result, ('{"reward": 1, "info": {"' + key + '": "' + key + '"}}').encode())
    else:
        print(f"hostile: unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

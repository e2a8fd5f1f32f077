"""Entrypoint of the ``tiny`` test baseline (standard library only).

Reads ``/run/cleanroom/manifest.json`` and acts on ``manifest["task"]["mode"]``:

- ``ok`` (default): prints to stdout and stderr, writes the artifact ``out/hello.txt`` and
  ``result.json`` with ``reward = seed * 0.5``.
- ``fail``: prints to stderr and exits 3 (no result).
- ``sleep``: sleeps ``task["seconds"]`` (default 3600), then behaves like ``ok``.
- ``write``: writes a canary (the episode id) to every path in ``task["paths"]``, and reports in
  ``info["seen"]`` which of ``task["probe"]`` exist (each with its content if a file): proves
  one episode never sees another's files.
- ``big``: writes the artifact ``out/big.bin`` of ``task["bytes"]`` bytes.
- ``leak``: prints the secret named ``task["secret"]`` (from its environment variable) to stdout,
  stderr, an artifact and the result record, and reports whether its file exists.
- ``net``: tries to reach the outside (TCP to addresses in ``task["targets"]``, DNS for
  ``task["names"]``) and reports each attempt's error, plus the network interfaces it sees.
- ``egress``: runs each probe of ``task["probes"]`` and reports its outcome in
  ``info["results"]`` (plus the interfaces, the proxy variable and resolv.conf): ``connect``
  (HTTP CONNECT to ``target`` through ``$HTTPS_PROXY``, then sends ``send``), ``http`` (an
  absolute-form GET of ``url`` through the proxy), ``tcp`` (a straight connection to
  ``target``, sending ``send``), ``resolve`` (DNS for ``name``; ``secret`` prefixes the value of
  that secret variable as a label).
- ``noresult``: exits 0 without writing result.json.
- ``panic``: crashes the guest kernel (sysrq ``c``).
- ``kill-agent``: SIGKILLs the guest agent (its channel closes).
- ``garbage``: writes junk straight into the agent's control port (an untrusted guest).
- ``evil-artifact``: writes a well-formed FILE frame naming ``../../escape`` into the port.

``CLEANROOM_DIR`` (set by the agent) locates ``/run/cleanroom``.
"""

import json
import os
import sys
import time

ROOT = os.environ.get("CLEANROOM_DIR", "/run/cleanroom")


def write_result(reward, info):
    tmp = ROOT + "/result.json.tmp"
    with open(tmp, "w") as f:
        json.dump({"reward": reward, "terminated": True, "info": info}, f)
    os.replace(tmp, ROOT + "/result.json")


def probe(path):
    if os.path.isfile(path):
        with open(path, errors="replace") as f:
            return f.read(200)
    return os.path.exists(path)


def control_port():
    """The agent's own channel, stolen with pidfd_getfd (as any root process in the guest can).

    A virtio port opens only once, so a compromised guest has to take the agent's descriptor.
    """
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


def probe_network(task):
    import socket

    attempts = {}
    for target in task.get("targets", []):
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                attempts[target] = "connected"
        except OSError as exc:
            attempts[target] = f"{type(exc).__name__}: {exc}"
    for name in task.get("names", []):
        try:
            attempts[name] = "resolved " + socket.gethostbyname(name)
        except OSError as exc:
            attempts[name] = f"{type(exc).__name__}: {exc}"
    return {"attempts": attempts, "interfaces": sorted(os.listdir("/sys/class/net"))}


def _exchange(sock, data):
    sock.sendall(data)
    sock.shutdown(1)  # SHUT_WR: the other side sees our EOF
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out.decode(errors="replace")


def _proxy_socket():
    import socket

    host, port = os.environ["HTTPS_PROXY"].removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def egress_probe(probe):
    import socket

    kind = probe["kind"]
    if kind == "connect":
        with _proxy_socket() as sock:
            sock.sendall(f"CONNECT {probe['target']} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head and (chunk := sock.recv(1)):
                head += chunk
            status = head.split(b"\r\n", 1)[0].decode()
            if " 200 " not in status:
                return status + " | " + _exchange(sock, b"")
            return status + " | " + _exchange(sock, probe.get("send", "").encode())
    if kind == "http":
        with _proxy_socket() as sock:
            return _exchange(sock, f"GET {probe['url']} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    if kind == "tcp":
        host, port = probe["target"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            return "reply " + _exchange(sock, probe.get("send", "").encode())
    if kind == "resolve":
        name = probe["name"]
        if probe.get("secret"):
            name = os.environ[probe["secret"]].lower() + "." + name
        return "resolved " + socket.gethostbyname(name)
    return f"unknown probe {kind}"


def probe_egress(task):
    results = []
    for probe in task.get("probes", []):
        try:
            results.append(egress_probe(probe))
        except (OSError, KeyError) as exc:
            results.append(f"{type(exc).__name__}: {exc}")
    with open("/etc/resolv.conf") as f:
        resolv = f.read()
    return {
        "results": results,
        "interfaces": sorted(os.listdir("/sys/class/net")),
        "proxy": os.environ.get("HTTPS_PROXY"),
        "resolv": resolv,
    }


def panic():
    with open("/proc/sysrq-trigger", "w") as f:
        f.write("c")
    return 1


def kill_agent():
    os.kill(os.getppid(), 9)
    time.sleep(60)
    return 1


def garbage():
    control_port().write(b"\x00\xffNOT A FRAME" * 1000)
    time.sleep(60)
    return 1


def evil_artifact():
    header = json.dumps({"name": "../../escape", "offset": 0, "eof": True, "kind": "artifact"})
    raw = header.encode()
    body = b"pwned"
    frame = b"CR" + bytes([8]) + len(raw).to_bytes(4, "big") + len(body).to_bytes(4, "big")
    control_port().write(frame + raw + body)
    time.sleep(60)
    return 1


CHAOS = {
    "panic": panic,
    "kill-agent": kill_agent,
    "garbage": garbage,
    "evil-artifact": evil_artifact,
}


def main():
    with open(ROOT + "/manifest.json") as f:
        manifest = json.load(f)
    task = manifest.get("task") or {}
    mode = task.get("mode", "ok")
    seed = manifest.get("seed", 0)
    episode = manifest.get("episode_id", "?")
    os.makedirs(ROOT + "/out", exist_ok=True)
    info = {"mode": mode, "episode_id": episode, "seed": seed}

    if mode in CHAOS:
        return CHAOS[mode]()
    if mode == "net":
        write_result(0.0, probe_network(task))
        return 0
    if mode == "egress":
        write_result(0.0, probe_egress(task))
        return 0
    if mode == "leak":
        name = task["secret"]
        value = os.environ.get(name, "")
        print(f"stdout leak {value}", flush=True)
        print(f"stderr leak {value}", file=sys.stderr, flush=True)
        with open(ROOT + "/out/leak.txt", "w") as f:
            f.write(f"artifact leak {value}\n")
        secret_file = ROOT + "/secrets/" + name
        file_value = None
        if os.path.exists(secret_file):
            with open(secret_file) as f:
                file_value = f.read()
        write_result(1.0, {"leak": value, "file_matches": file_value == value != ""})
        return 0
    if mode == "noresult":
        print("tiny: exiting without a result", flush=True)
        return 0
    if mode == "fail":
        print(f"tiny: failing on purpose ({episode})", file=sys.stderr, flush=True)
        return 3
    if mode == "sleep":
        time.sleep(float(task.get("seconds", 3600)))
    elif mode == "write":
        for path in task.get("paths", []):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(episode)
        info["seen"] = {p: probe(p) for p in task.get("probe", []) if os.path.exists(p)}
    elif mode == "big":
        size = int(task.get("bytes", 0))
        with open(ROOT + "/out/big.bin", "wb") as f:
            block = b"x" * (1 << 20)
            while size > 0:
                f.write(block[: min(size, len(block))])
                size -= len(block)
    elif mode != "ok":
        print(f"tiny: unknown mode {mode!r}", file=sys.stderr, flush=True)
        return 2

    with open(ROOT + "/out/hello.txt", "w") as f:
        f.write(f"hello from {episode}\n")
    print(f"tiny: stdout {episode} seed={seed}", flush=True)
    print(f"tiny: stderr {episode}", file=sys.stderr, flush=True)
    write_result(seed * 0.5, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())

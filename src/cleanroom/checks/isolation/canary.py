"""Canaries of ``cleanroom check isolation``. Runs INSIDE an env (standard library only).

The check PUTs this file into an env and runs it with the env's ``python3``::

    canary.py plant --token T [--prefix P]    plant every canary, report what was planted
    canary.py probe --token T [--prefix P]    report which canaries named T are visible

Both print one JSON object: ``planted`` (plant) or ``seen`` (probe), name -> evidence;
``skipped``, name -> why it could not be planted; ``observed``, values the host compares
between episodes (the sysctls, 32 bytes of ``/dev/urandom``, the boot id).

``--prefix`` is where the env's ``/`` lies on the host for drivers without a VM (``fake``):
files then go under it and the sysctls are only simulated there (the host's are never
touched). In a VM the prefix is empty and everything is real: the files land in the guest's
root overlay, the sysctls change the guest kernel, the background process is a real orphan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

FILES = {
    "file:/": "/{token}",
    "file:/root": "/root/.{token}",
    "file:/tmp": "/tmp/{token}",
    "file:/var/tmp": "/var/tmp/{token}",
    "cache:pip": "/root/.cache/pip/http/{token}/wheel.bin",
    "cache:huggingface": "/root/.cache/huggingface/hub/models--cleanroom--{token}/config.json",
}
APPENDS = {
    "etc:hosts": ("/etc/hosts", "127.0.0.9 {token}\n"),
    "env:/etc/environment": ("/etc/environment", "CLEANROOM_CANARY={token}\n"),
    "env:/root/.profile": ("/root/.profile", "export CLEANROOM_CANARY_PROFILE={token}\n"),
}
SYSCTLS = {
    "sysctl:kernel.hostname": "/proc/sys/kernel/hostname",
    "sysctl:vm.swappiness": "/proc/sys/vm/swappiness",
}
PROCESS = "process:background"
LOGIN = "env:login-shell"
RANDOM = "rng:urandom"
BOOT_ID = "rng:boot_id"
NAMES = (*FILES, *APPENDS, LOGIN, PROCESS, *SYSCTLS, RANDOM, BOOT_ID)
"""Every canary, in the order the check reports them."""
LINGER_S = 900  # the background process outlives its entrypoint by this much at most


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, text: str, mode: str = "w") -> None:
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def processes_with(token: str) -> list[int]:
    """Pids (not this one) whose command line names the token."""
    needle, found = token.encode(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def linger(token: str) -> list[int]:
    """Double-fork + setsid: a process that outlives the entrypoint; its pids once seen."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        time.sleep(LINGER_S)  # this process's command line still names the token
        os._exit(0)
    os.waitpid(child, 0)
    for _ in range(200):
        pids = processes_with(token)
        if pids:
            return pids
        time.sleep(0.01)
    return []


def observe(prefix: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, path in SYSCTLS.items():
        value = _read(prefix + path)
        out[name] = value.strip() if value is not None else None
    with open("/dev/urandom", "rb") as f:
        out[RANDOM] = f.read(32).hex()
    boot_id = _read("/proc/sys/kernel/random/boot_id")
    out[BOOT_ID] = boot_id.strip() if boot_id else None
    return out


def _plant_file(path: str, text: str, mode: str = "w") -> str:
    _write(path, text, mode)
    return path


def plant(token: str, prefix: str) -> dict[str, object]:
    planted: dict[str, str] = {}
    skipped: dict[str, str] = {}

    def attempt(name: str, path: str, text: str, mode: str = "w", note: str = "") -> None:
        try:
            planted[name] = _plant_file(path, text, mode) + note
        except OSError as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"

    for name, path in FILES.items():
        attempt(name, prefix + path.format(token=token), token)
    for name, (path, line) in APPENDS.items():
        attempt(name, prefix + path, line.format(token=token), "a")
    if prefix:
        skipped[LOGIN] = "no VM: a login shell would read the host's profile"
    else:
        planted[LOGIN] = "via /etc/environment and /root/.profile"
    for name, path in SYSCTLS.items():
        original = (_read(path) or "").strip()
        value = token if name.endswith("hostname") else ("7" if original != "7" else "13")
        note = f" = {value}" + (" (simulated: no VM)" if prefix else "")
        attempt(name, prefix + path, value + "\n", note=note)
    pids = linger(token)
    if pids:
        planted[PROCESS] = f"pids {pids} (setsid, double fork)"
    else:
        skipped[PROCESS] = "the background process did not appear"
    return {"planted": planted, "skipped": skipped, "observed": observe(prefix)}


def probe(token: str, prefix: str) -> dict[str, object]:
    seen: dict[str, str] = {}
    for name, path in FILES.items():
        target = prefix + path.format(token=token)
        folder = os.path.dirname(target)
        if os.path.lexists(target) or (token in folder and os.path.isdir(folder)):
            seen[name] = f"{target} exists"
    for name, (path, _) in APPENDS.items():
        text = _read(prefix + path) or ""
        if token in text:
            seen[name] = f"{prefix + path} names the token"
    if not prefix:  # a login shell reads /etc/profile and ~/.profile
        env = {"HOME": "/root", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
        try:
            shell = subprocess.run(
                ["sh", "-l", "-c", "env"], env=env, capture_output=True, timeout=60
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            shell = b""
        if token.encode() in shell:
            seen[LOGIN] = "a login shell's environment names the token"
    if any(token in value for value in os.environ.values()):
        seen[LOGIN] = "this process's environment names the token"
    pids = processes_with(token)
    if pids:
        seen[PROCESS] = f"pids {pids} name the token"
    observed = observe(prefix)
    for name in SYSCTLS:
        if token in (observed.get(name) or ""):
            seen[name] = f"{name} = {observed[name]}"
    return {"seen": seen, "observed": observed}


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("plant", "probe") or argv[1] != "--token":
        print("usage: canary.py plant|probe --token T [--prefix P]", file=sys.stderr)
        return 2
    token = argv[2]
    prefix = argv[4] if len(argv) >= 5 and argv[3] == "--prefix" else ""
    report = plant(token, prefix) if argv[0] == "plant" else probe(token, prefix)
    print(json.dumps(report, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Start one command unprivileged in its own namespaces (the launcher behind ``confine.py``).

Run by path as ``python3 -I -S sandbox_exec.py CONFIG_JSON -- ARGV...`` by host root; standard
library only, so it starts in a few milliseconds and imports nothing of cleanroom. It forks a
child that unshares a user, mount, PID, IPC and UTS namespace (and a network namespace unless the
config asks for the host's network); the launcher, still host root, writes the child's uid and
gid maps: namespace ids ``0 .. COUNT-1`` are host ids ``BASE .. BASE+COUNT-1``, none of which is
a host user's. The child then builds the sandbox's root and becomes namespace root (host uid
``BASE``: no capability on the host, no host file it may write), forks PID 1 of the new PID
namespace, which execs ``ARGV``. When PID 1 exits, the kernel kills every process left in the
namespace.

The root is either ``tree`` (the image's own tree is ``/``: nothing of the host is visible, the
way image content runs) or a fresh tmpfs holding the host's system folders read-only plus the
config's ``mounts`` (the way cleanroom's own build code runs, with the tree at ``/tree``). Every
mount is made before the switch of root, with paths the host chose; no path inside the tree is
followed before ``pivot_root``.

Exit status: the command's own, or 128 + its signal; 125 when the sandbox could not be made
(the reason on stderr, one line starting ``sandbox:``).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = 155  # x86-64
SANDBOX_FAILED = 125
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxFailed(Exception):
    """The sandbox could not be made (not the command's failure)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SandboxFailed(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def _locked_flags(path: str) -> int:
    """The flags a read-only remount of a bind of ``path`` must keep (the kernel refuses to
    drop nosuid/nodev/noexec a user namespace did not set)."""
    flag = os.statvfs(path).f_flag
    kept = 0
    for st, ms in (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if flag & st:
            kept |= ms
    return kept


def _bind(source: str, target: str, writable: bool) -> None:
    """Bind the host path ``source`` onto ``target`` (relative to the sandbox's root, made as
    a folder or an empty file), read-only unless ``writable``."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with open(target, "ab"):
            pass
    _mount(source, target, None, MS_BIND | MS_REC)
    if not writable:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | _locked_flags(source)
        _mount(None, target, None, flags)


def _system_root(root: str, config: dict[str, object]) -> None:
    """A tmpfs at ``root`` with the host's system folders read-only, /dev's harmless devices,
    a private /tmp, /proc if asked, and the config's mounts; made as host root in this private
    mount namespace, which namespace root will not be able to change."""
    owner = f"uid={config['base']},gid={config['base']}"
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size=16m,mode=0755,{owner}")
    os.chdir(root)
    for name in SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), name)
        elif os.path.isdir(host):
            _bind(host, name, writable=False)
    os.makedirs("dev", exist_ok=True)  # its own mount: a tool that remounts /dev (buildah) can
    _mount("tmpfs", "dev", "tmpfs", 0, f"size=64k,mode=0755,{owner}")  # keep its flags
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            _bind("/dev/" + name, "dev/" + name, writable=True)
    os.makedirs("tmp", exist_ok=True)
    _mount("tmpfs", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size=64m,mode=1777,{owner}")
    mounts = config.get("mounts") or []
    assert isinstance(mounts, list)
    for mount in mounts:
        _bind(mount["source"], mount["target"].lstrip("/"), bool(mount["writable"]))
    if config.get("proc"):  # for a tool that needs them (buildah): its own /proc, /sys read-only
        os.makedirs("proc", exist_ok=True)
        _mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _bind("/sys", "sys", writable=False)


def _enter() -> None:
    """Make the current folder the root of this mount namespace, the host's root detached."""
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


def _limits(config: dict[str, object]) -> None:
    for name, value in (config.get("rlimits") or {}).items():  # type: ignore[attr-defined]
        limit = getattr(resource, "RLIMIT_" + name.upper())
        resource.setrlimit(limit, (int(value), int(value)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _open_inputs(config: dict[str, object]) -> list[int]:
    """The config's ``inputs`` (host files the command reads but namespace root may not be
    allowed to), opened read-only by the launcher as host root, never through a link."""
    paths = config.get("inputs") or []
    assert isinstance(paths, list)
    return [os.open(str(p), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW) for p in paths]


def _pass_inputs(fds: list[int], as_stdin: bool) -> None:
    """The inputs as descriptors 3, 4, ... of the command, in order; with ``as_stdin`` the
    only input is its standard input instead."""
    if as_stdin:
        os.dup2(fds[0], 0)
        os.close(fds[0])
        return
    base = 3 + len(fds) + 64
    moved = [os.dup2(fd, base + i, inheritable=False) for i, fd in enumerate(fds)]
    for i, fd in enumerate(moved):
        os.dup2(fd, 3 + i)
    for fd in moved:
        os.close(fd)


def _pid_one(
    config: dict[str, object], argv: list[str], inputs: list[int], ready_w: int, mapped_r: int
) -> None:
    """PID 1 of the sandbox: make its root (still host root, in the private mount namespace),
    enter a user namespace, wait for the launcher's id maps, become namespace root, exec."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    tree, root = config.get("tree"), config.get("root")
    if tree:
        assert isinstance(tree, str)
        _mount(tree, tree, None, MS_BIND)
        os.chdir(tree)
    else:
        assert isinstance(root, str)
        _system_root(root, config)
    _enter()
    _check(_libc.unshare(CLONE_NEWUSER), "unshare the user namespace")
    os.write(ready_w, b"u")
    if os.read(mapped_r, 1) != b"m":
        raise SandboxFailed("the launcher could not write the id maps")
    os.setresgid(0, 0, 0)
    os.setgroups([])
    os.setresuid(0, 0, 0)
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _limits(config)
    os.chdir(str(config.get("cwd") or "/"))
    _pass_inputs(inputs, bool(config.get("stdin_input")))
    env = config.get("env") or {}
    assert isinstance(env, dict)
    os.execve(argv[0], argv, {str(k): str(v) for k, v in env.items()})


def _status(raw: int) -> int:
    if os.WIFSIGNALED(raw):
        return 128 + os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def _write_maps(pid: int, base: int, count: int) -> None:
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"0 {base} {count}\n")


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: sandbox_exec.py CONFIG_JSON -- ARGV...", file=sys.stderr)
        return SANDBOX_FAILED
    config = json.loads(args[0])
    argv = args[2:]
    os.umask(0o022)  # the sandbox's own folders are traversable by namespace root
    try:
        inputs = _open_inputs(config)
    except OSError as exc:
        print(f"sandbox: cannot open an input: {exc}", file=sys.stderr, flush=True)
        return SANDBOX_FAILED
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not config.get("network"):
        flags |= CLONE_NEWNET
    try:
        _check(_libc.unshare(flags), "unshare")
    except SandboxFailed as exc:
        print(f"sandbox: {exc}", file=sys.stderr, flush=True)
        return SANDBOX_FAILED
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
            os.close(ready_r)
            os.close(mapped_w)
            _pid_one(config, argv, inputs, ready_w, mapped_r)
        except (SandboxFailed, OSError) as exc:
            print(f"sandbox: {exc}", file=sys.stderr, flush=True)
        os._exit(SANDBOX_FAILED)
    os.close(ready_w)
    os.close(mapped_r)
    if os.read(ready_r, 1) == b"u":
        try:
            _write_maps(pid, int(config["base"]), int(config["count"]))
            os.write(mapped_w, b"m")
        except OSError as exc:
            print(f"sandbox: id maps: {exc}", file=sys.stderr, flush=True)
    os.close(mapped_w)
    return _status(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main(sys.argv[1:]))

"""The unprivileged identity a VMM drops to: one uid (and gid) per env, from a reserved range.

Like Firecracker's jailer: a compromised VMM runs as a uid no other process has, so it cannot
signal or ptrace another env's VMM, and owns no file (it opens everything it needs as root,
before it drops). ``allocate`` hands out a uid no one else uses, safely across concurrent
controllers on the host:

  - an flock on ``LOCK_DIR/<uid>`` (a root-only 0700 folder: no local user can take or hold a
    lock), taken without blocking; the locked file descriptor is passed to the VMM's process
    tree, so the uid stays taken exactly as long as a process of that env lives (a SIGKILLed
    controller's VMM keeps it until it is gone) and nothing has to release it;
  - no process runs as the uid now (a VMM that unlocked its inherited descriptor still
    holds its uid this way);
  - the uid is nobody's: no passwd or group entry, not inside a range of ``/etc/subuid`` or
    ``/etc/subgid`` (a user with a subordinate range can map it in a user namespace and then
    act as it).

The range is ``CLEANROOM_JAIL_UIDS`` (``START-END``; ``off`` turns the jail off), by default
``DEFAULT_RANGE``: below 2**31 for tools that read uids as signed. Dropping needs root; as
another user there is no jail (``unavailable`` says why, and provenance records it).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cleanroom.errors import ConfigError
from cleanroom.host.private import private_dir

SWITCH_ENV = "CLEANROOM_JAIL_UIDS"  # "START-END", or "off"
DEFAULT_RANGE = (2_100_000_000, 2_100_065_535)
LOCK_DIR = Path("/run/cleanroom/jail-uids")
SUBORDINATE = (Path("/etc/subuid"), Path("/etc/subgid"))


@dataclass(frozen=True)
class Lease:
    """A uid taken for one env: ``fd`` holds the lock (pass it to the env's processes, then
    ``close`` this process's copy)."""

    uid: int
    fd: int

    @property
    def gid(self) -> int:
        return self.uid  # a group of its own: no file is group-shared with another env

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def configured_range() -> tuple[int, int] | None:
    """The reserved range (inclusive), or None when switched off; ConfigError if malformed."""
    text = os.environ.get(SWITCH_ENV, "").strip().lower()
    if not text:
        return DEFAULT_RANGE
    if text == "off":
        return None
    try:
        start, end = (int(part) for part in text.split("-", 1))
    except ValueError:
        raise ConfigError(f"{SWITCH_ENV}={text!r}: expected START-END (uids) or off") from None
    if not 1000 <= start <= end < 2**32 - 1:
        raise ConfigError(f"{SWITCH_ENV}={text!r}: need 1000 <= START <= END < 4294967295")
    return start, end


def unavailable() -> str | None:
    """Why there is no jail on this host (None: there is one)."""
    try:
        if configured_range() is None:
            return f"switched off ({SWITCH_ENV}=off)"
    except ConfigError as exc:
        return str(exc)
    if os.geteuid() != 0:
        return "the controller is not root: it cannot drop a VMM to another uid"
    return None


def is_jail_uid(uid: int | None) -> bool:
    """Is ``uid`` one of the reserved range, which only a root controller hands out? (Then a
    process running as it is an env's: no user can become it.)"""
    try:
        bounds = configured_range()
    except ConfigError:
        return False
    return uid is not None and bounds is not None and bounds[0] <= uid <= bounds[1]


def ours(uid: int | None) -> bool:
    """A process of this controller's: its own uid, or (root) a jail uid."""
    return uid == os.geteuid() or (os.geteuid() == 0 and is_jail_uid(uid))


def _subordinate_ranges() -> list[tuple[int, int]]:
    ranges = []
    for path in SUBORDINATE:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                parts = line.strip().split(":")
                with contextlib.suppress(ValueError, IndexError):
                    first, count = int(parts[1]), int(parts[2])
                    ranges.append((first, first + count - 1))
    return ranges


def nobodys(uid: int, subordinate: list[tuple[int, int]]) -> bool:
    """No user, group or subordinate range has ``uid``."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return False
        except KeyError:
            pass
    return not any(first <= uid <= last for first, last in subordinate)


def uids_in_use() -> set[int]:
    """The uids every process on the host runs as."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                found.add(os.stat(f"/proc/{name}").st_uid)
    return found


def _candidates(start: int, end: int) -> Iterator[int]:
    first = random.randint(start, end)  # spread concurrent controllers over the range
    yield from range(first, end + 1)
    yield from range(start, first)


def _try_lock(uid: int) -> int | None:
    path = LOCK_DIR / str(uid)
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def allocate() -> Lease:
    """A uid of the reserved range that no one holds or uses (module docstring); ConfigError
    if there is no jail here or every uid of the range is taken."""
    why = unavailable()
    bounds = configured_range()
    if why is not None or bounds is None:
        raise ConfigError(f"no VMM jail: {why}")
    private_dir(LOCK_DIR)
    subordinate, in_use = _subordinate_ranges(), uids_in_use()
    for uid in _candidates(*bounds):
        if uid in in_use or not nobodys(uid, subordinate):
            continue
        fd = _try_lock(uid)
        if fd is None:
            continue
        if uid in uids_in_use():  # started meanwhile under a lock it then dropped
            os.close(fd)
            continue
        return Lease(uid, fd)
    raise ConfigError(f"every jail uid of {bounds[0]}-{bounds[1]} is taken ({SWITCH_ENV})")

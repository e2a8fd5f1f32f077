"""Memory and pids limits of an env's cgroup, in whichever hierarchy the host has them.

On a pure cgroup v2 host the env's own cgroup (``cgroups.py``) carries them (``memory.max``,
``memory.swap.max``, ``pids.max``) once the controllers are enabled down to it. On a hybrid host
(this machine: v2 without controllers, v1 ``memory`` and ``pids``) each limit is a cgroup of the
same layout (``<hierarchy>/cleanroom/<scope>/<env_id>``) in its v1 hierarchy
(``memory.limit_in_bytes``, ``pids.max``) that the env's first process joins beside its identity
cgroup. ``Limit.enforced`` says, for provenance, what was set where (or why not).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys/fs/cgroup")
TOP = "cleanroom"


@dataclass(frozen=True)
class EnvLimits:
    """What one env may use: bytes of memory (the VMM's own included) and tasks (threads)."""

    memory_bytes: int
    pids: int


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's limit is written: ``root`` of a v1 hierarchy, or the v2 tree."""

    controller: str  # "memory" or "pids"
    root: Path
    v2: bool

    def files(self, limits: EnvLimits) -> dict[str, str]:
        if self.controller == "pids":
            return {"pids.max": str(limits.pids)}
        if self.v2:
            return {"memory.max": str(limits.memory_bytes), "memory.swap.max": "0"}
        return {"memory.limit_in_bytes": str(limits.memory_bytes)}

    def describe(self) -> str:
        return f"{'v2' if self.v2 else 'v1'} {', '.join(self.files(EnvLimits(0, 0)))}"


def _v2_enable(root: Path, scope: str, controllers: Sequence[str]) -> bool:
    """Enable ``controllers`` for the env cgroups under ``root/cleanroom/scope`` (again after
    the scope went with its last env)."""
    want = " ".join(f"+{c}" for c in controllers)
    try:
        for folder in (root, root / TOP, root / TOP / scope):
            folder.mkdir(exist_ok=True)
            (folder / "cgroup.subtree_control").write_text(want)
    except OSError:
        return False
    return True


@functools.cache
def _v1(controller: str, probe: str) -> Hierarchy | None:
    root = SYSFS / controller
    try:
        (root / TOP).mkdir(exist_ok=True)
    except OSError:
        return None
    return Hierarchy(controller, root, v2=False) if (root / TOP / probe).exists() else None


def hierarchies(v2_root: Path | None, scope: str) -> list[Hierarchy]:
    """The memory and pids hierarchies an env's limits go in (empty: none usable)."""
    if v2_root is not None:
        try:
            offered = (v2_root / "cgroup.controllers").read_text().split()
        except OSError:
            offered = []
        usable = [c for c in ("memory", "pids") if c in offered]
        if usable and _v2_enable(v2_root, scope, usable):
            return [Hierarchy(c, v2_root, v2=True) for c in usable]
    found = [_v1("memory", "memory.limit_in_bytes"), _v1("pids", "pids.max")]
    return [h for h in found if h is not None]


class Limit:
    """The limit cgroups of one driver's envs (v1 ones; a v2 limit lives in the env's own)."""

    def __init__(self, found: list[Hierarchy], scope: str) -> None:
        self.found = found
        self.scope = scope

    def separate(self) -> list[Hierarchy]:
        return [h for h in self.found if not h.v2]

    def path(self, h: Hierarchy, env_id: str) -> Path:
        return h.root / TOP / self.scope / env_id

    def prepare(self) -> None:
        """Before an env cgroup is made in the v2 tree: its controllers enabled above it."""
        v2 = [h for h in self.found if h.v2]
        if v2 and not _v2_enable(v2[0].root, self.scope, [h.controller for h in v2]):
            raise OSError(f"cannot enable {', '.join(h.controller for h in v2)} for envs")

    def create(self, env_id: str, limits: EnvLimits, v2_path: Path | None) -> list[Path]:
        """Make the v1 limit cgroups and write every limit (OSError if one cannot be); the
        folders the env's first process joins besides its identity cgroup."""
        joined = []
        for h in self.found:
            path = v2_path if h.v2 and v2_path is not None else self.path(h, env_id)
            if not h.v2:
                path.mkdir(parents=True, exist_ok=True)
                joined.append(path)
            for name, value in h.files(limits).items():
                (path / name).write_text(value)
        return joined

    def remove(self, env_id: str) -> bool:
        """Remove the v1 limit cgroups (empty once the env's processes are gone)."""
        gone = True
        for h in self.separate():
            path = self.path(h, env_id)
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
                continue
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        return gone

    def enforced(self, limits: EnvLimits) -> dict[str, str]:
        """Per controller, what was written (``v1 memory.limit_in_bytes``) or why nothing."""
        have = {h.controller: h.describe() for h in self.found}
        return {c: have.get(c, "not enforced: no usable hierarchy") for c in ("memory", "pids")}

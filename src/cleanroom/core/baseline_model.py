"""A built baseline as the rest of cleanroom sees it.

On disk a baseline is one folder ``$CLEANROOM_HOME/baselines/<hex>/`` holding its components and
``baseline.json``. The digest is the sha256 of the canonical JSON of ``identity()``: every
component's name, size and sha256, plus the entrypoint (a command, or a ``function`` entry:
only present when set, so command baselines keep their identity), default limits, kernel version,
agent version and the egress allowlist (only if the spec has one). Nothing time- or
host-dependent enters it, so the same spec builds to the same digest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.core.limits import Limits
from cleanroom.core.run_as import RunAs
from cleanroom.host.digests import digest_of

FORMAT_VERSION = 1
METADATA_FILE = "baseline.json"
KERNEL_FILE = "vmlinux"
INITRD_FILE = "initrd.cpio"
ROOTFS_FILE = "rootfs.erofs"
AGENT_FILE = "agent"
"""A native baseline's agent binary: the bytes inside ``rootfs.erofs``, kept beside it as a
component so its sha256 is in the digest, in ``baseline.json`` and in every record."""


@dataclass(frozen=True)
class Component:
    """One file of a baseline."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class FunctionEntry:
    """A Python entrypoint: ``module:function`` called in a fork of the warm worker, which
    imported ``preimport`` with ``path`` first on ``sys.path`` (the guest's ``entry.json``)."""

    function: str
    preimport: tuple[str, ...] = ()
    path: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "preimport": list(self.preimport),
            "path": list(self.path),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FunctionEntry:
        return cls(str(data["function"]), tuple(data["preimport"]), tuple(data["path"]))


@dataclass(frozen=True)
class Baseline:
    """A built, content-addressed baseline (immutable)."""

    digest: str  # "sha256:<hex>"
    path: Path  # the baseline's folder
    spec_digest: str
    name: str
    components: tuple[Component, ...]
    entrypoint: tuple[str, ...]  # the command; empty when ``function`` is set
    limits: Limits
    kernel_version: str
    agent_version: str
    spec: dict[str, Any] = field(default_factory=dict)
    function: FunctionEntry | None = None
    network: tuple[str, ...] | None = None  # the egress allowlist (None: no network)
    image: dict[str, Any] | None = None  # the container image it came from
    lock: dict[str, Any] | None = None  # what went in (``lock.py``); its digest is in identity

    @property
    def short(self) -> str:
        return self.digest.removeprefix("sha256:")[:12]

    @property
    def kernel(self) -> Path:
        return self.path / KERNEL_FILE

    @property
    def initrd(self) -> Path:
        return self.path / INITRD_FILE

    @property
    def rootfs(self) -> Path:
        return self.path / ROOTFS_FILE

    def identity(self) -> dict[str, Any]:
        """Everything the digest covers."""
        return identity(
            self.components,
            self.entrypoint,
            self.limits,
            self.kernel_version,
            self.agent_version,
            self.spec_digest,
            self.function,
            network=self.network,
            image=self.image,
            lock_digest=digest_of(self.lock) if self.lock is not None else None,
        )

    def components_by_name(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)

    @property
    def agent_sha256(self) -> str | None:
        """The sha256 of the native agent binary it runs (None: a baseline built for the removed
        Python agent)."""
        agent = self.components_by_name(AGENT_FILE)
        return agent.sha256 if agent is not None else None

    @property
    def image_env(self) -> dict[str, str]:
        """The image config's ``Env`` as a mapping (empty for a Debian baseline); with a
        ``User``, ``HOME`` is that user's home unless ``Env`` sets one (as ``docker run``)."""
        return self.env_for()

    def env_for(self, user: str | None = None) -> dict[str, str]:
        """``image_env`` for a command run as ``user`` (``"root"``: no image user's HOME)."""
        pairs = (item.partition("=") for item in (self.image or {}).get("env", []))
        env = {name: value for name, _, value in pairs if name}
        if self.run_as is not None and user != "root":
            env.setdefault("HOME", self.run_as.home)
        return env

    @property
    def run_as(self) -> RunAs | None:
        """The image config's ``User`` (resolved at build time), if the image runs as one."""
        data = (self.image or {}).get("run_as")
        return RunAs.from_json(data) if isinstance(data, dict) else None

    def as_user(self, argv: list[str], user: str | None = None) -> list[str]:
        """``argv`` as the guest agent should run it: through the ``User`` helper when the
        image names a user (``user="root"``: as root, like ``docker exec -u root``)."""
        run_as = self.run_as
        return argv if run_as is None or user == "root" else run_as.wrap(argv)

    @property
    def image_entrypoint(self) -> tuple[str, ...]:
        """The image config's ``Entrypoint`` (what ``docker run`` starts first), if it set one."""
        return tuple(str(a) for a in (self.image or {}).get("entrypoint") or ())

    @property
    def workdir(self) -> str | None:
        """The image config's ``WorkingDir``, if it set one."""
        return (self.image or {}).get("working_dir") or None

    def to_json(self) -> dict[str, Any]:
        data = self.identity()
        data.update(digest=self.digest, name=self.name, spec=self.spec)
        if self.lock is not None:
            data["lock"] = self.lock
        return data

    @classmethod
    def from_json(cls, path: Path, data: dict[str, Any]) -> Baseline:
        return cls(
            digest=data["digest"],
            path=path,
            spec_digest=data["spec_digest"],
            name=data.get("name", ""),
            components=tuple(Component(**c) for c in data["components"]),
            entrypoint=tuple(data["entrypoint"]),
            limits=Limits.model_validate(data["limits"]),
            kernel_version=data["kernel_version"],
            agent_version=data["agent_version"],
            spec=data.get("spec", {}),
            function=FunctionEntry.from_json(data["function"]) if "function" in data else None,
            network=tuple(data["network"]) if data.get("network") is not None else None,
            image=data.get("image"),
            lock=data.get("lock"),
        )


def identity(
    components: tuple[Component, ...],
    entrypoint: tuple[str, ...],
    limits: Limits,
    kernel_version: str,
    agent_version: str,
    spec_digest: str,
    function: FunctionEntry | None = None,
    *,
    network: tuple[str, ...] | None = None,
    image: dict[str, Any] | None = None,
    lock_digest: str | None = None,
) -> dict[str, Any]:
    """The canonical, digest-covered description of a baseline (``function``, ``network`` and
    ``image`` only if set, so baselines without them keep their digests)."""
    ident = {
        "format": FORMAT_VERSION,
        "components": [
            {"name": c.name, "size": c.size, "sha256": c.sha256}
            for c in sorted(components, key=lambda c: c.name)
        ],
        "entrypoint": list(entrypoint),
        "limits": limits.model_dump(mode="json", exclude_none=True),
        "kernel_version": kernel_version,
        "agent_version": agent_version,
        "spec_digest": spec_digest,
    }
    if function is not None:
        ident["function"] = function.to_json()
    if network is not None:
        ident["network"] = list(network)
    if image is not None:
        ident["image"] = image
    if lock_digest is not None:
        ident["lock"] = lock_digest
    return ident

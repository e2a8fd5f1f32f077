"""The baseline spec (``baseline.toml``): what a baseline is built from.

``load_spec(path)`` validates the whole file and raises one ``SpecError`` naming the file and every
bad field (``files.0.dest: must be an absolute path``). ``spec_digest(spec)`` is the build cache
key: it covers the spec's canonical JSON, the content (and exec bit) of every file it copies in,
the guest agent, the initramfs ``/init`` and ``BUILDER_VERSION``; change any of them and the
baseline is rebuilt. ``builder_fingerprint()`` (the builder's source) is checked beside it.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from cleanroom.agent import native
from cleanroom.baseline.oci import check_ref
from cleanroom.core.limits import Limits
from cleanroom.errors import SpecError
from cleanroom.network.policy import checked_allowlist

BUILDER_VERSION = "1"
"""Bump when the builder's output changes for the same inputs (invalidates every cached build)."""
SOURCE_DATE_EPOCH = 1_700_000_000
"""Every timestamp in the image (2023-11-14). Not 0: zip cannot store dates before 1980, and a
shadow ``lastchg`` of 0 would force a password change."""
BUILDER_SOURCES = (
    "builder.py",
    "confine.py",
    "dockerfile.py",
    "image_user.py",
    "initramfs.py",
    "inroot.py",
    "intree.py",
    "kernel.py",
    "layers.py",
    "oci.py",
    "pyinstall.py",
    "rootfs.py",
    "runas.c",
    "sandbox_exec.py",
    "spec.py",
    "treefiles.py",
    "users.py",
    "../core/baseline_model.py",  # what a built baseline records (its model lives at the bottom)
    "../core/run_as.py",
)
"""The builder's own modules. Their hash (``builder_fingerprint``) is kept next to each cached
build, not in the spec digest: editing the builder makes the next ``build`` rebuild (seconds,
with the download caches) instead of trusting a stale cache, yet a rebuild that yields the same
bytes keeps the same baseline digest."""

ALWAYS_PACKAGES = ("libpython3-stdlib", "python3-minimal")
"""Always installed in a Debian baseline: a function entrypoint's warm worker and the gym process
run in the image's Python with its standard library (json is not in python3-minimal)."""
AGENT_DIR = Path(__file__).resolve().parent.parent / "agent"
NATIVE_GYM_FILES = native.GYM_FILES
"""The gym process's files in a native baseline with a gym config (the agent starts it)."""
GYM_CONFIG = "/etc/cleanroom/gym.json"  # gym_worker.CONFIG_FILE
INIT_SCRIPT = Path(__file__).resolve().parent / "init.sh"
SKIP_NAMES = frozenset(
    {"baseline.lock", "__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
)
"""Names never copied from a spec's files (host caches; they would make builds irreproducible)."""

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}\Z")
DEB_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?\Z")
RESERVED_DESTS = ("/proc", "/sys", "/dev", "/run", "/opt/cleanroom")
MODULE_RE = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
FUNCTION_RE = rf"^{MODULE_RE}:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseSection(_Section):
    """The root filesystem: a Debian tree built with mmdebstrap, or a container ``image``
    (``oci-archive:PATH``, ``docker-archive:PATH``, ``oci:DIR[:TAG]``, ``docker://REF``)."""

    suite: str = Field(default="bookworm", pattern=r"^[a-z][a-z0-9-]*$")
    variant: Literal["minbase", "essential", "apt", "required", "important", "standard"] = "minbase"
    packages: list[str] = Field(default_factory=list)
    image: str | None = Field(default=None, max_length=4096)
    dockerfile: str | None = Field(default=None, min_length=1, max_length=4096)
    context: str | None = Field(default=None, min_length=1, max_length=4096)

    @field_validator("image")
    @classmethod
    def _image_ref(cls, value: str | None) -> str | None:
        return None if value is None else check_ref(value)

    @model_validator(mode="after")
    def _image_or_debian(self) -> BaseSection:
        if self.image is not None and self.dockerfile is not None:
            raise ValueError("give one of image or dockerfile")
        if self.from_image and self.packages:
            raise ValueError("packages cannot be added to an image (build them into the image)")
        if self.context is not None and self.dockerfile is None:
            raise ValueError("context needs a dockerfile")
        return self

    @property
    def from_image(self) -> bool:
        """True when the root filesystem comes from a container image (or a Dockerfile)."""
        return self.image is not None or self.dockerfile is not None

    @field_validator("packages")
    @classmethod
    def _debian_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not DEB_RE.match(name):
                raise ValueError(f"{name!r} is not a Debian package name (name or name=version)")
        return value

    def all_packages(self) -> tuple[str, ...]:
        """The packages to include: the spec's plus ``ALWAYS_PACKAGES``, sorted, no repeats."""
        return tuple(sorted(set(self.packages) | set(ALWAYS_PACKAGES)))

    def canonical(self) -> dict[str, Any]:
        """``image``/``dockerfile`` only when set (Debian specs keep their digests); an image
        has no suite."""
        if not self.from_image:
            return self.model_dump(mode="json", exclude={"image", "dockerfile", "context"})
        fields = self.model_dump(mode="json", include={"image", "dockerfile", "context"})
        return {k: v for k, v in fields.items() if v is not None}


class PipSection(_Section):
    """Python packages installed (as wheels for the guest's Python) at build time."""

    packages: list[str] = Field(default_factory=list)

    @field_validator("packages")
    @classmethod
    def _requirements(cls, value: list[str]) -> list[str]:
        for req in value:
            if not req.strip() or req.lstrip().startswith("-"):
                raise ValueError(f"{req!r} is not a requirement (options are not allowed)")
        return value


class FileEntry(_Section):
    """A file or folder copied into the root filesystem."""

    src: str = Field(min_length=1, description="relative to the spec file's folder")
    dest: str = Field(min_length=2, description="absolute path inside the guest")

    @field_validator("dest")
    @classmethod
    def _absolute_and_safe(cls, value: str) -> str:
        path = PurePosixPath(value)
        if not path.is_absolute():
            raise ValueError("must be an absolute path")
        if ".." in path.parts:
            raise ValueError("must not contain '..'")
        for reserved in RESERVED_DESTS:
            if path == PurePosixPath(reserved) or PurePosixPath(reserved) in path.parents:
                raise ValueError(f"must not be under {reserved} (reserved by cleanroom)")
        return str(path)


class EntrypointSection(_Section):
    """What the guest agent runs for each episode: a ``command``, or a Python ``function``
    (``module:function``) called in a fork of a worker that imported ``preimport`` (and the
    function's module) before the snapshot."""

    command: list[str] | None = Field(default=None, min_length=1)
    function: str | None = Field(default=None, pattern=FUNCTION_RE)
    preimport: list[str] = Field(default_factory=list)

    @field_validator("preimport")
    @classmethod
    def _modules(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(MODULE_RE, name):
                raise ValueError(f"{name!r} is not a module name")
        return value

    @model_validator(mode="after")
    def _one_entry(self) -> EntrypointSection:
        if (self.command is None) == (self.function is None):
            raise ValueError("give exactly one of command or function")
        if self.preimport and self.function is None:
            raise ValueError("preimport needs a function entrypoint")
        return self

    def canonical(self) -> dict[str, Any]:
        """Only the fields that are set: a command spec keeps its JSON (and digest) as before."""
        data = self.model_dump(mode="json")
        return {k: v for k, v in data.items() if v is not None and v != []}


class KernelSection(_Section):
    """The Debian package the guest kernel comes from."""

    package: str = Field(default="linux-image-cloud-amd64", pattern=r"^linux-image-[a-z0-9.+-]+$")


class NetworkSection(_Section):
    """The most network any episode of this baseline may get: an egress allowlist
    (``cleanroom.network.policy``). Unset: no network at all."""

    allow: list[str] = Field(default_factory=list)

    @field_validator("allow")
    @classmethod
    def _entries(cls, value: list[str]) -> list[str]:
        return checked_allowlist(value)


class AgentSection(_Section):
    """The guest agent the baseline runs as PID 1: ``native``, the only one (``agent/native``,
    static C, needs nothing from the image, so an image of only busybox or one program works; a
    function entrypoint runs in the warm Python worker it starts, so that one needs Python 3 in
    the image). The Python agent (``kind = "python"``) is gone: a spec asking for it is refused."""

    kind: str = "native"

    @field_validator("kind")
    @classmethod
    def _native(cls, value: str) -> str:
        if value == "python":
            raise ValueError(
                '"python": the Python guest agent was removed; the native agent is the one '
                'guest agent (remove [agent] kind, or write kind = "native")'
            )
        if value != "native":
            raise ValueError(f'{value[:40]!r}: the one guest agent is "native"')
        return value


class BaselineSpec(_Section):
    """A validated ``baseline.toml``; ``folder`` is where relative ``files.src`` resolve."""

    name: str
    base: BaseSection = Field(default_factory=BaseSection)
    pip: PipSection = Field(default_factory=PipSection)
    files: list[FileEntry] = Field(default_factory=list)
    entrypoint: EntrypointSection | None = None
    limits: Limits = Field(default_factory=Limits)
    kernel: KernelSection = Field(default_factory=KernelSection)
    network: NetworkSection | None = None
    agent: AgentSection = Field(default_factory=AgentSection)

    _folder: Path = PrivateAttr(default=Path("."))

    @model_validator(mode="after")
    def _has_entrypoint(self) -> BaselineSpec:
        if self.entrypoint is None and not self.base.from_image:
            raise ValueError("entrypoint: required (only an image baseline may use its own)")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError("must be 1-63 of a-z, 0-9, '.', '_', '-', starting alphanumeric")
        return value

    @property
    def folder(self) -> Path:
        return self._folder

    def canonical(self) -> dict[str, Any]:
        """The spec as plain JSON data (what ``baseline.json`` records under ``spec``).

        ``network`` appears only when set; ``agent`` never (it can only be the native one, and
        baselines from before ``[agent]`` existed keep their digests)."""
        data = {
            **self.model_dump(mode="json"),
            "base": self.base.canonical(),
            "entrypoint": self.entrypoint.canonical() if self.entrypoint else None,
        }
        if self.network is None:
            del data["network"]
        del data["agent"]
        if self.entrypoint is None:
            del data["entrypoint"]  # the image's Entrypoint + Cmd
        return data

    def warm_config(self) -> dict[str, Any] | None:
        """The warm worker's config for a function entrypoint (None for a command): the
        function, the modules to pre-import and ``path``, the guest folders put first on
        ``sys.path`` (each ``[[files]]`` folder's dest; a single file's parent folder)."""
        entry = self.entrypoint
        if entry is None or entry.function is None:
            return None
        path: list[str] = []
        for src, item in self.sources():
            folder = item.dest if src.is_dir() else str(PurePosixPath(item.dest).parent)
            if folder not in path:
                path.append(folder)
        return {"function": entry.function, "preimport": list(entry.preimport), "path": path}

    def image_ref(self) -> str | None:
        """``base.image`` with a local path made absolute against the spec's folder."""
        ref = self.base.image
        path = image_path(ref, self.folder) if ref is not None else None
        if ref is None or path is None:
            return ref
        scheme, _, rest = ref.partition(":")
        tag = rest.split(":", 1)[1] if scheme == "oci" and ":" in rest else ""
        return f"{scheme}:{path}" + (f":{tag}" if tag else "")

    def dockerfile_paths(self) -> tuple[Path, Path] | None:
        """``(Dockerfile, build context)`` resolved against the spec's folder, if any."""
        if self.base.dockerfile is None:
            return None
        dockerfile = (self.folder / self.base.dockerfile).resolve()
        context = self.base.context
        return dockerfile, (self.folder / context).resolve() if context else dockerfile.parent

    def has_gym(self) -> bool:
        """Whether the baseline lists Gymnasium envs (a ``[[files]]`` entry at ``GYM_CONFIG``)."""
        return any(entry.dest == GYM_CONFIG for entry in self.files)

    def sources(self) -> Iterator[tuple[Path, FileEntry]]:
        """Each files entry with its source resolved against the spec's folder."""
        for entry in self.files:
            yield (self.folder / entry.src).resolve(), entry


def _describe(error: ValidationError) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in item['loc']) or '(spec)'}: {item['msg']}"
        for item in error.errors()
    ]


def load_spec(path: Path) -> BaselineSpec:
    """Read and validate a ``baseline.toml``; SpecError names the file and every bad field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such spec file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML ({exc})") from exc
    except RecursionError as exc:  # tomllib recurses into nested arrays and tables
        raise SpecError(f"{path}: nested too deeply to be a baseline spec") from exc
    try:
        spec = BaselineSpec.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(f"  {p}" for p in _describe(exc))
        raise SpecError(f"{path}: invalid baseline spec\n{problems}") from exc
    spec._folder = path.resolve().parent
    missing = [
        f"  files.{i}.src: {entry.src!r} does not exist (looked in {spec.folder})"
        for i, (src, entry) in enumerate(spec.sources())
        if not src.exists()
    ]
    image = spec.base.image
    local = image_path(image, spec.folder) if image is not None else None
    if local is not None and not local.exists():
        missing.append(f"  base.image: {local} does not exist")
    docker = spec.dockerfile_paths()
    if docker is not None and not docker[0].is_file():
        missing.append(f"  base.dockerfile: {docker[0]} does not exist")
    if docker is not None and not docker[1].is_dir():
        missing.append(f"  base.context: {docker[1]} is not a folder")
    if missing:
        raise SpecError(f"{path}: invalid baseline spec\n" + "\n".join(missing))
    return spec


def walk_files(root: Path) -> Iterator[tuple[str, Path]]:
    """Every file or symlink under ``root`` as (relative posix path, path), sorted, skipping
    host caches (``SKIP_NAMES``, ``*.pyc``). A single file yields itself as ``("", root)``."""
    if not root.is_dir() or root.is_symlink():
        yield "", root
        return
    entries: list[tuple[str, Path]] = []
    for child in root.rglob("*"):
        rel = child.relative_to(root)
        if SKIP_NAMES.intersection(rel.parts) or child.suffix == ".pyc":
            continue
        if child.is_symlink() or child.is_file():
            entries.append((rel.as_posix(), child))
    yield from sorted(entries)


def _hash_file_into(h: Any, label: str, path: Path) -> None:
    """Feed one file (name, kind, exec bit, content or link target) into a hash."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        kind, body = "link", str(path.readlink()).encode()
    else:
        kind = "exec" if info.st_mode & 0o111 else "file"
        body = path.read_bytes()
    h.update(f"{label}\0{kind}\0{len(body)}\0".encode())
    h.update(hashlib.sha256(body).digest())


def spec_digest(spec: BaselineSpec) -> str:
    """The build cache key of a spec: ``sha256:<hex>`` (see the module docstring)."""
    h = hashlib.sha256()
    h.update(f"cleanroom-baseline-spec\0{BUILDER_VERSION}\0".encode())
    h.update(json.dumps(spec.canonical(), sort_keys=True, separators=(",", ":")).encode())
    for index, (src, entry) in enumerate(spec.sources()):
        for rel, path in walk_files(src):
            _hash_file_into(h, f"files.{index}:{entry.dest}:{rel}", path)
    for name in native.files():
        _hash_file_into(h, f"agent-native:{name}", native.NATIVE_DIR / name)
    if spec.warm_config() is not None:  # the warm worker travels with it
        _hash_file_into(h, "agent:worker.py", AGENT_DIR / "worker.py")
    if spec.has_gym():  # and the gym process
        for name in NATIVE_GYM_FILES:
            _hash_file_into(h, f"agent:{name}", AGENT_DIR / name)
    _hash_file_into(h, "init.sh", INIT_SCRIPT)
    if spec.base.image is not None:
        h.update(f"image\0{image_content_key(spec.base.image, spec.folder)}\0".encode())
    docker = spec.dockerfile_paths()
    if docker is not None:
        _hash_file_into(h, "dockerfile", docker[0])
        for rel, path in walk_files(docker[1]):
            _hash_file_into(h, f"context:{rel}", path)
    return "sha256:" + h.hexdigest()


def image_path(ref: str, folder: Path) -> Path | None:
    """The local file or folder an image reference names (relative to the spec's folder)."""
    scheme = next((s for s in ("oci-archive:", "docker-archive:", "oci:") if ref.startswith(s)), "")
    if not scheme:
        return None
    name = ref.removeprefix(scheme)
    if scheme == "oci:":
        name = name.split(":", 1)[0]
    return (folder / name).resolve()


def image_content_key(ref: str, folder: Path) -> str:
    """What a local image's bytes are, for the cache key: an archive's sha256, a layout's
    ``index.json`` (its manifests name every blob by digest); a registry ref as written."""
    path = image_path(ref, folder)
    if path is None:
        return ref
    target = path / "index.json" if path.is_dir() else path
    try:
        with open(target, "rb") as f:
            return ref + "\0" + hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return ref + "\0(unreadable)"  # the build itself reports what is wrong


def _fingerprint() -> str:
    h = hashlib.sha256(f"cleanroom-builder\0{BUILDER_VERSION}\0".encode())
    for name in BUILDER_SOURCES:
        _hash_file_into(h, name, INIT_SCRIPT.parent / name)
    return h.hexdigest()[:16]


_FINGERPRINT = _fingerprint()  # at import: the code this process runs, even if files change later


def builder_fingerprint() -> str:
    """A hash of the builder's own source (``BUILDER_SOURCES``) as this process loaded it."""
    return _FINGERPRINT

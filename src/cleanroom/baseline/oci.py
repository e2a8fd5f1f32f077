"""Container images as the base of a baseline: where they come from and what they say.

An image reference is one of::

    oci-archive:PATH        a tar of an OCI image layout (``skopeo copy … oci-archive:``)
    docker-archive:PATH     ``docker save`` output
    oci:DIR[:TAG]           an OCI image layout folder
    docker://REF            pulled from a registry with ``skopeo`` (daemonless)

``fetch(ref, work)`` turns any of them into an ``Image``: its manifest and config digests, its
layers (each a blob file whose sha256 and size were checked against the manifest: a tampered
layer is refused by digest) and its config (``Env``, ``WorkingDir``, ``User``, ``Entrypoint``,
``Cmd``). ``unpack(image, tree)`` applies the layers in order (``layers.apply_layer``).
Every failure is a ``BuildError`` naming the image and the part that is wrong.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.baseline.inroot import resolve_in_root
from cleanroom.baseline.layers import Blob, Budget, ImageLimits, apply_layer
from cleanroom.baseline.proc import Progress, quiet, run
from cleanroom.errors import BuildError

SCHEMES = ("oci-archive:", "docker-archive:", "oci:", "docker://")
MAX_JSON_BYTES = 4 << 20
"""Most bytes of an index, manifest or config (they are small; a huge one is hostile)."""
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")
DECOMPRESSORS: dict[bytes, Any] = {b"\x1f\x8b": gzip, b"BZ": bz2, b"\xfd7z": lzma}
"""Magic bytes -> the module that opens such a compressed layer."""
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image config a baseline honours."""

    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    def command(self) -> tuple[str, ...]:
        """``Entrypoint`` + ``Cmd``: what ``docker run IMAGE`` would run."""
        return self.entrypoint + self.cmd


@dataclass(frozen=True)
class Image:
    """An image whose blobs are on disk and match their digests."""

    ref: str
    manifest_digest: str
    config_digest: str
    layers: tuple[tuple[str, Path], ...]  # (digest, blob file), bottom first
    config: ImageConfig = field(default_factory=ImageConfig)

    def identity(self) -> dict[str, Any]:
        """What a baseline and its provenance record of the image."""
        return {
            "ref": self.ref,
            "manifest": self.manifest_digest,
            "config": self.config_digest,
            "layers": [digest for digest, _ in self.layers],
        }


def check_ref(ref: str) -> str:
    """``ref`` if it has a known scheme, else ``ValueError`` listing them (for spec validation)."""
    if not ref.startswith(SCHEMES) or len(ref) <= max(len(s) for s in SCHEMES if ref.startswith(s)):
        raise ValueError(f"{ref!r}: an image is one of {', '.join(s + '…' for s in SCHEMES)}")
    return ref


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _diff_id(path: Path) -> str:
    """The sha256 of a layer's uncompressed tar (what an image config's ``diff_ids`` list)."""
    with open(path, "rb") as f:
        magic = f.read(6)
    for prefix, codec in DECOMPRESSORS.items():
        if magic.startswith(prefix):
            digest = hashlib.sha256()
            try:
                with codec.open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
            except (OSError, EOFError, lzma.LZMAError) as exc:
                raise BuildError(f"layer {path.name}: corrupt compressed data ({exc})") from exc
            return "sha256:" + digest.hexdigest()
    return _sha256(path)


def _read_json(path: Path, what: str, ref: str) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise BuildError(f"image {ref}: {what} is over {MAX_JSON_BYTES} bytes")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise BuildError(f"image {ref}: cannot read {what} ({exc})") from exc
    if not isinstance(data, dict):
        raise BuildError(f"image {ref}: {what} is not a JSON object")
    return data


def _config(data: dict[str, Any], ref: str) -> ImageConfig:
    conf = data.get("config") or {}
    if not isinstance(conf, dict):
        raise BuildError(f"image {ref}: config.config is not an object")

    def strings(key: str) -> tuple[str, ...]:
        value = conf.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BuildError(f"image {ref}: config {key} is not a list of strings")
        return tuple(value)

    def text(key: str) -> str:
        value = conf.get(key) or ""
        if not isinstance(value, str):
            raise BuildError(f"image {ref}: config {key} is not a string")
        return value

    return ImageConfig(
        env=strings("Env"),
        working_dir=text("WorkingDir"),
        user=text("User"),
        entrypoint=strings("Entrypoint"),
        cmd=strings("Cmd"),
    )


# -- OCI layouts ----------------------------------------------------------------------------------


def _blob(layout: Path, descriptor: Any, what: str, ref: str) -> Path:
    """The blob a descriptor names, checked against its digest and size."""
    if not isinstance(descriptor, dict):
        raise BuildError(f"image {ref}: {what} descriptor is not an object")
    digest, size = descriptor.get("digest"), descriptor.get("size")
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise BuildError(f"image {ref}: {what} has no sha256 digest ({digest!r})")
    path = layout / "blobs" / "sha256" / digest.removeprefix("sha256:")
    if not path.is_file():
        raise BuildError(f"image {ref}: {what} blob {digest} is missing")
    if isinstance(size, int) and path.stat().st_size != size:
        raise BuildError(f"image {ref}: {what} blob {digest} has the wrong size")
    if _sha256(path) != digest:
        raise BuildError(f"image {ref}: {what} blob {digest} does not match its digest (tampered)")
    return path


def _pick(index: dict[str, Any], tag: str | None, ref: str) -> Any:
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise BuildError(f"image {ref}: the index lists no manifests")
    if tag is not None:
        named = [
            m
            for m in manifests
            if isinstance(m, dict)
            and (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag
        ]
        if not named:
            raise BuildError(f"image {ref}: no manifest tagged {tag!r}")
        return named[0]
    if len(manifests) > 1:
        amd64 = [
            m
            for m in manifests
            if isinstance(m, dict)
            and (m.get("platform") or {}).get("architecture") == "amd64"
            and (m.get("platform") or {}).get("os", "linux") == "linux"
        ]
        if len(amd64) != 1:
            raise BuildError(f"image {ref}: {len(manifests)} manifests; name one with oci:DIR:TAG")
        return amd64[0]
    return manifests[0]


def from_layout(layout: Path, tag: str | None, ref: str) -> Image:
    """The image in an OCI layout folder (``tag``: its ref.name annotation, if several)."""
    descriptor = _pick(_read_json(layout / "index.json", "index.json", ref), tag, ref)
    for _ in range(2):  # an index may point at a nested index (multi-arch)
        path = _blob(layout, descriptor, "manifest", ref)
        manifest = _read_json(path, "manifest", ref)
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            descriptor = _pick(manifest, None, ref)
            continue
        break
    else:
        raise BuildError(f"image {ref}: indexes nested too deep")
    config_path = _blob(layout, manifest.get("config"), "config", ref)
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        raise BuildError(f"image {ref}: manifest lists no layers")
    blobs = tuple(
        (str(d["digest"]), _blob(layout, d, f"layer {i}", ref)) for i, d in enumerate(layers)
    )
    return Image(
        ref=ref,
        manifest_digest=str(descriptor["digest"]),
        config_digest=_sha256(config_path),
        layers=blobs,
        config=_config(_read_json(config_path, "config", ref), ref),
    )


# -- archives -------------------------------------------------------------------------------------


def _unpack_archive(archive: Path, into: Path, ref: str) -> None:
    """Extract an image archive (only plain files and folders, never outside ``into``)."""
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:
                if not (member.isreg() or member.isdir()):
                    continue  # docker save's per-layer symlinks: the blobs are what counts
                parts = tuple(p for p in Path(member.name).parts if p not in ("/", "."))
                if ".." in parts or not parts:
                    raise BuildError(f"image {ref}: archive member {member.name!r} escapes")
                target = resolve_in_root(into, parts, ref)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is not None:
                    with source, open(target, "wb") as out:
                        while chunk := source.read(1 << 20):
                            out.write(chunk)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BuildError(f"image {ref}: cannot read the archive {archive} ({exc})") from exc


def from_docker_archive(folder: Path, ref: str) -> Image:
    """The first image of an unpacked ``docker save`` archive (or its OCI layout, if it has one)."""
    if (folder / "index.json").is_file() and (folder / "blobs").is_dir():
        return from_layout(folder, None, ref)  # docker >= 25 writes an OCI layout too
    path = folder / "manifest.json"
    try:
        entries = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise BuildError(f"image {ref}: cannot read manifest.json ({exc})") from exc
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise BuildError(f"image {ref}: manifest.json lists no image")
    entry = entries[0]

    def member(name: Any, what: str) -> Path:
        if not isinstance(name, str) or ".." in Path(name).parts or name.startswith("/"):
            raise BuildError(f"image {ref}: {what} path {name!r} is not inside the archive")
        found = folder / name
        if not found.is_file():
            raise BuildError(f"image {ref}: {what} {name} is missing")
        return found

    config_path = member(entry.get("Config"), "config")
    config = _read_json(config_path, "config", ref)
    names = entry.get("Layers")
    if not isinstance(names, list):
        raise BuildError(f"image {ref}: manifest.json lists no layers")
    layers = tuple(member(n, f"layer {i}") for i, n in enumerate(names))
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    checked = []
    for i, layer in enumerate(layers):
        digest = _sha256(layer)
        if i < len(diff_ids) and diff_ids[i] not in (digest, _diff_id(layer)):
            raise BuildError(
                f"image {ref}: layer {i} does not match diff_id {diff_ids[i]} (tampered)"
            )
        checked.append((digest, layer))
    manifest_bytes = json.dumps(entry, sort_keys=True).encode()
    return Image(
        ref=ref,
        manifest_digest="sha256:" + hashlib.sha256(manifest_bytes).hexdigest(),
        config_digest=_sha256(config_path),
        layers=tuple(checked),
        config=_config(config, ref),
    )


# -- entry points ---------------------------------------------------------------------------------


def _registry(ref: str) -> str:
    name = ref.removeprefix("docker://")
    first = name.split("/", 1)[0]
    return first if ("." in first or ":" in first or first == "localhost") else "docker.io"


def _pull(ref: str, into: Path, progress: Progress) -> Image:
    registry = _registry(ref)
    progress("image", f"skopeo copy {ref}")
    local = registry.startswith(("127.", "localhost", "[::1]"))
    argv = ["skopeo", "copy", "--quiet", "--retry-times", "0"]
    if local:
        argv.append("--src-tls-verify=false")  # a loopback registry serves plain HTTP
    into.mkdir(parents=True, exist_ok=True)
    try:
        run([*argv, ref, f"oci:{into}:image"], "image")
    except BuildError as exc:
        raise BuildError(f"image {ref}: cannot pull from registry {registry}: {exc}") from exc
    return from_layout(into, "image", ref)


def fetch(ref: str, work: Path, progress: Progress = quiet) -> Image:
    """``ref`` as an ``Image`` whose blobs lie under ``work`` (or in the layout it names)."""
    check_ref(ref)
    if ref.startswith("docker://"):
        return _pull(ref, work / "pulled", progress)
    if ref.startswith("oci:"):
        where, _, tag = ref.removeprefix("oci:").partition(":")
        if not Path(where).is_dir():
            raise BuildError(f"image {ref}: no OCI layout folder at {where}")
        return from_layout(Path(where), tag or None, ref)
    scheme, _, name = ref.partition(":")
    archive = Path(name)
    if not archive.is_file():
        raise BuildError(f"image {ref}: no such archive {archive}")
    progress("image", f"reading {archive.name}")
    folder = work / "archive"
    folder.mkdir(parents=True, exist_ok=True)
    _unpack_archive(archive, folder, ref)
    if scheme == "oci-archive":
        return from_layout(folder, None, ref)
    return from_docker_archive(folder, ref)


def unpack(
    layers: list[tuple[str, Blob]],
    tree: Path,
    progress: Progress = quiet,
    limits: ImageLimits | None = None,
) -> None:
    """Apply the layers ``(digest, blob)``, bottom first, onto the folder ``tree``, within one
    image's ``limits``. Runs in the build sandbox (``intree``)."""
    tree.mkdir(parents=True, exist_ok=True)
    budget = Budget.for_tree(tree, limits or ImageLimits())
    for i, (digest, blob) in enumerate(layers):
        stats = apply_layer(tree, blob, digest, budget)
        progress(
            "image",
            f"layer {i + 1}/{len(layers)} {digest[7:19]}: {stats.files} entries, "
            f"{stats.deleted} whiteouts",
        )

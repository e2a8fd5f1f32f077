"""The local baseline store: find, list and check built baselines.

Layout (under ``baselines_dir()``)::

    <hex>/                 one immutable baseline: vmlinux, initrd.cpio, rootfs.erofs,
                           baseline.json (identity + digest + name + spec + "built" facts)
    by-spec/<hex>          spec digest -> baseline digest and builder fingerprint (build cache)

References accepted by ``resolve``: a full digest ``sha256:<64 hex>``, a unique hex prefix of at
least 6 characters (with or without ``sha256:``), a baseline's name as ``baseline ls`` shows it
(when one stored baseline has it), or a spec that was already built: the path of its
``baseline.toml`` or of the folder holding one (``resolve_or_build`` also builds it).

Checks: ``verify`` re-hashes every component and recomputes the digest (slow, exact);
``quick_check`` compares sizes and the mtimes recorded at build time, re-hashing only a
component whose mtime moved (cheap, run before every use); ``require_intact`` is ``verify``
that raises. Both raise/return in terms of component names, e.g. ``rootfs.erofs``.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from cleanroom.core.baseline_model import METADATA_FILE, Baseline
from cleanroom.errors import BaselineNotFound, DriftError
from cleanroom.host import digests
from cleanroom.host.digests import digest_of, sha256_file
from cleanroom.host.paths import baselines_dir

MIN_PREFIX = 6
HEX_RE = re.compile(r"[0-9a-f]+\Z")


def by_spec_dir() -> Path:
    return baselines_dir() / "by-spec"


def metadata(baseline: Baseline) -> dict[str, Any]:
    """The baseline's ``baseline.json`` as stored (includes the ``built`` facts)."""
    data: dict[str, Any] = json.loads((baseline.path / METADATA_FILE).read_text())
    return data


def load(digest: str) -> Baseline:
    """The stored baseline with this full digest; BaselineNotFound if absent."""
    hex_digest = digest.removeprefix("sha256:")
    folder = baselines_dir() / hex_digest
    meta = folder / METADATA_FILE
    if len(hex_digest) != 64 or not HEX_RE.match(hex_digest) or not meta.is_file():
        raise BaselineNotFound(f"no baseline {digest} in {baselines_dir()}")
    try:
        baseline = Baseline.from_json(folder, json.loads(meta.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DriftError(f"sha256:{hex_digest}", [METADATA_FILE]) from exc
    if baseline.digest != f"sha256:{hex_digest}":
        raise DriftError(f"sha256:{hex_digest}", [METADATA_FILE])
    return baseline


def list_baselines() -> list[Baseline]:
    """Every readable baseline in the store, newest build first."""
    root = baselines_dir()
    found: list[tuple[float, Baseline]] = []
    if not root.is_dir():
        return []
    for folder in root.iterdir():
        if len(folder.name) != 64 or not HEX_RE.match(folder.name):
            continue
        try:
            baseline = load(folder.name)
        except (BaselineNotFound, DriftError):
            continue
        found.append(((folder / METADATA_FILE).stat().st_mtime, baseline))
    return [b for _, b in sorted(found, key=lambda item: (-item[0], item[1].digest))]


def lookup_spec(spec_digest: str, fingerprint: str | None = None) -> Baseline | None:
    """The baseline last built from a spec digest, if it is still in the store (and, when
    ``fingerprint`` is given, was built by that version of the builder)."""
    link = by_spec_dir() / spec_digest.removeprefix("sha256:")
    try:
        digest, _, built_by = link.read_text().partition("\n")
        if fingerprint is not None and built_by.strip() != fingerprint:
            return None
        return load(digest.strip())
    except (OSError, BaselineNotFound, DriftError):
        return None


def record_spec(spec_digest: str, digest: str, fingerprint: str = "") -> None:
    """Remember (atomically) that ``spec_digest`` built ``digest`` with builder ``fingerprint``."""
    folder = by_spec_dir()
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / spec_digest.removeprefix("sha256:")
    tmp = folder / f".{link.name}.{os.getpid()}.tmp"
    tmp.write_text(f"{digest}\n{fingerprint}\n")
    os.replace(tmp, link)


SPEC_FILE = "baseline.toml"


def _looks_like_spec(ref: str) -> bool:
    return ref.endswith(".toml") or os.sep in ref or Path(ref).exists()


def spec_file(ref: str) -> Path | None:
    """The spec ``ref`` names (a ``.toml`` path, or a folder holding ``baseline.toml``), or
    None if ``ref`` is no path; BaselineNotFound for a folder without a spec."""
    if not _looks_like_spec(ref):
        return None
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / SPEC_FILE).is_file():
            raise BaselineNotFound(f"{ref}: a folder, but it holds no {SPEC_FILE}")
        return path / SPEC_FILE
    return path


def _prefixed(hex_ref: str) -> list[str]:
    root = baselines_dir()
    names = sorted(p.name for p in root.glob(f"{hex_ref}*")) if root.is_dir() else []
    return [n for n in names if len(n) == 64]


def _named(name: str) -> Baseline | None:
    """The one stored baseline called ``name``; None if none is; refused if several are."""
    found = [b for b in list_baselines() if b.name == name]
    if len(found) > 1:
        shown = ", ".join(b.short for b in found[:5])
        raise BaselineNotFound(
            f"{len(found)} stored baselines are named {name!r} ({shown}, newest first): "
            "name one by its digest prefix, or by its spec"
        )
    return found[0] if found else None


def resolve(ref: str) -> Baseline:
    """A baseline by full digest, unique hex prefix (>= 6), name, or built spec (file or folder)."""
    hex_ref = ref.strip().removeprefix("sha256:").lower()
    if HEX_RE.match(hex_ref) and len(hex_ref) == 64:
        return load(hex_ref)
    spec = spec_file(ref)
    if spec is not None:
        from cleanroom.baseline.spec import load_spec, spec_digest

        found = lookup_spec(spec_digest(load_spec(spec)))
        if found is None:
            raise BaselineNotFound(f"{ref} has not been built; run: cleanroom baseline build {ref}")
        return found
    if HEX_RE.match(hex_ref) and len(hex_ref) >= MIN_PREFIX:
        names = _prefixed(hex_ref)
        if len(names) > 1:
            shown = ", ".join(n[:12] for n in names[:5])
            raise BaselineNotFound(f"{ref!r} is ambiguous: matches {len(names)} ({shown})")
        if names:
            return load(names[0])
    named = _named(ref.strip())
    if named is not None:
        return named
    if HEX_RE.match(hex_ref) and len(hex_ref) < MIN_PREFIX:
        raise BaselineNotFound(f"{ref!r}: a digest prefix needs at least {MIN_PREFIX} hex digits")
    if HEX_RE.match(hex_ref):
        raise BaselineNotFound(f"no baseline matches {ref!r} in {baselines_dir()}")
    raise BaselineNotFound(
        f"{ref!r} is neither a digest, a digest prefix, a baseline name (see `cleanroom "
        "baseline ls`) nor a spec file or folder"
    )


# -- checks ---------------------------------------------------------------------------------------


# file -> its (device, inode, size, mtime, ctime) when this process last hashed it clean
_HASHED_CLEAN: dict[Path, tuple[int, int, int, int, int]] = {}
SETTLED_S = 2.0  # a signature is trusted only for files unchanged this long before the hash


def verify(baseline: Baseline, *, reuse: bool = False) -> list[str]:
    """Names of components (or ``baseline.json``) that no longer match; empty when intact.

    Works on any baseline folder (a copy elsewhere too): it checks content, not location.
    With ``reuse``, a file this process already hashed clean is not hashed again while its
    device, inode, size, mtime and ctime are those it had then: user space cannot set a ctime,
    and every write, chmod or replacement changes it (git trusts its index the same way). A
    process that runs many batches then pays the full re-hash once, not once per run.
    """
    drifted: list[str] = []
    for component in baseline.components:
        path = baseline.path / component.name
        try:
            info = path.stat()
            signature = digests.signature(info)
            if reuse and _HASHED_CLEAN.get(path) == signature:
                continue
            ok = info.st_size == component.size and sha256_file(path) == component.sha256
        except OSError:
            ok = False
        if not ok:
            _HASHED_CLEAN.pop(path, None)
            drifted.append(component.name)
        elif info.st_ctime_ns < time.time_ns() - int(SETTLED_S * 1e9):
            _HASHED_CLEAN[path] = signature  # taken before the hash: a later write changes it
    if digest_of(baseline.identity()) != baseline.digest:
        drifted.append(METADATA_FILE)
    return sorted(set(drifted))


def require_intact(baseline: Baseline, *, reuse: bool = False) -> None:
    """``verify``, raising DriftError naming the drifted files."""
    drifted = verify(baseline, reuse=reuse)
    if drifted:
        raise DriftError(baseline.digest, drifted)


def quick_check(baseline: Baseline) -> None:
    """Cheap drift check (sizes, recorded mtimes; re-hash only what moved); DriftError if not."""
    try:
        recorded: dict[str, int] = metadata(baseline).get("built", {}).get("mtime_ns", {})
    except (OSError, ValueError, AttributeError):
        recorded = {}  # no build facts: re-hash everything (the digest check still applies)
    drifted: list[str] = []
    for component in baseline.components:
        path = baseline.path / component.name
        try:
            info = path.stat()
        except OSError:
            drifted.append(component.name)
            continue
        if info.st_size != component.size or (
            recorded.get(component.name) != info.st_mtime_ns
            and sha256_file(path) != component.sha256
        ):
            drifted.append(component.name)
    if digest_of(baseline.identity()) != baseline.digest:
        drifted.append(METADATA_FILE)
    if drifted:
        raise DriftError(baseline.digest, sorted(set(drifted)))

"""The lock: the resolved version of everything that went into a baseline.

A build records it in ``baseline.json`` (``lock``, with its digest in the baseline's identity)
and, if there is none yet, as ``baseline.lock`` (JSON) beside the spec::

    {"format": 1, "debian": {"packages": {"bash": "5.2.15-2+b7", ...}, "release": [...]},
     "pip": [{"name": "gymnasium", "version": "1.0.0", "sha256": "...", "url": "..."}],
     "kernel": {"package": "linux-image-cloud-amd64", "version": "6.1.0-57-cloud-amd64",
                "deb": "linux-image-6.1.0-57-cloud-amd64_6.1.192-3_amd64.deb"},
     "image": {"manifest": "sha256:...", "config": "sha256:...", "layers": [...]}}

``build --locked`` installs exactly those versions (apt pins, pip ``--require-hashes``), and
``check_*`` fail by name when what the build got is not what the lock says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cleanroom.errors import BuildError
from cleanroom.host.digests import digest_of

LOCK_FILE = "baseline.lock"
FORMAT = 1


def lock_path(spec_file: Path) -> Path:
    return spec_file.parent / LOCK_FILE


def read(spec_file: Path) -> dict[str, Any]:
    """The lock beside ``spec_file``; a ``BuildError`` saying how to make one if absent."""
    path = lock_path(spec_file)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise BuildError(
            f"{path}: no lock to build from; make one with `cleanroom baseline lock {spec_file}`"
        ) from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise BuildError(f"{path}: not a readable lock ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BuildError(f"{path}: not a cleanroom lock of format {FORMAT}")
    return data


def write(spec_file: Path, lock: dict[str, Any]) -> Path:
    """Write ``lock`` beside the spec (atomically)."""
    path = lock_path(spec_file)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def lock_digest(lock: dict[str, Any]) -> str:
    return digest_of(lock)


def dpkg_packages(status: str) -> dict[str, str]:
    """``name -> version`` of every installed package in a ``/var/lib/dpkg/status`` text."""
    found: dict[str, str] = {}
    for stanza in status.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            arch = fields.get("Architecture", "")
            name = fields["Package"]
            name = name if arch in ("", "all", "amd64") else f"{name}:{arch}"
            found[name] = fields.get("Version", "")
    return dict(sorted(found.items()))


def tree_packages(tree: Path) -> dict[str, str]:
    """The Debian packages installed in a root tree (empty if it has no dpkg database)."""
    status = tree / "var" / "lib" / "dpkg" / "status"
    if not status.is_file() or status.is_symlink():
        return {}
    return dpkg_packages(status.read_text(encoding="utf-8", errors="replace"))


def pip_items(report: dict[str, Any]) -> list[dict[str, str]]:
    """The exact wheels of a ``pip install --report`` JSON, sorted by name."""
    items = []
    for entry in report.get("install", []):
        meta = entry.get("metadata", {})
        info = entry.get("download_info", {})
        hashes = (info.get("archive_info") or {}).get("hashes") or {}
        items.append(
            {
                "name": str(meta.get("name", "")).lower(),
                "version": str(meta.get("version", "")),
                "sha256": str(hashes.get("sha256", "")),
                "url": str(info.get("url", "")),
            }
        )
    return sorted(items, key=lambda i: i["name"])


def pip_requirements(items: list[dict[str, str]]) -> str:
    """A ``--require-hashes`` requirements file for exactly the locked wheels."""
    lines = []
    for item in items:
        if not item.get("sha256"):
            raise BuildError(f"lock: pip package {item.get('name')} has no sha256 to pin")
        lines.append(f"{item['name']}=={item['version']} --hash=sha256:{item['sha256']}")
    return "\n".join(lines) + "\n"


def apt_preferences(packages: dict[str, str]) -> str:
    """An apt preferences file pinning every locked package to its version."""
    return "".join(
        f"Package: {name}\nPin: version {version}\nPin-Priority: 1001\n\n"
        for name, version in sorted(packages.items())
    )


def spec_pins(packages: list[str]) -> dict[str, str]:
    """``name -> version`` of the spec's ``[base] packages`` written ``name=version``."""
    pairs = (item.partition("=") for item in packages)
    return {name: version for name, sep, version in pairs if sep}


def check_pinned(pinned: dict[str, str], got: dict[str, str]) -> None:
    """Fail by name unless every ``name=version`` of the spec is what the tree holds."""
    wrong = [
        f"{name}={version} (the tree has {got.get(name, 'none')})"
        for name, version in sorted(pinned.items())
        if got.get(name) != version
    ]
    if wrong:
        raise BuildError(f"[base] packages: pinned versions not installed: {', '.join(wrong)}")


def check_packages(locked: dict[str, str], got: dict[str, str]) -> None:
    """Fail by name unless the tree holds exactly the locked Debian packages."""
    wrong = [
        f"{name} (locked {locked.get(name, 'absent')}, got {got.get(name, 'absent')})"
        for name in sorted(set(locked) | set(got))
        if locked.get(name) != got.get(name)
    ]
    if wrong:
        raise BuildError(
            "lock: these Debian packages are not available at the locked version: "
            + ", ".join(wrong[:20])
            + (f" and {len(wrong) - 20} more" if len(wrong) > 20 else "")
        )


def check_equal(what: str, locked: Any, got: Any) -> None:
    """Fail naming ``what`` unless the build got exactly what the lock says."""
    if locked != got:
        raise BuildError(f"lock: {what} is locked to {locked!r} but the build got {got!r}")


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human-readable changes from lock ``a`` to lock ``b`` (packages, wheels, kernel, image)."""
    out = []
    pa = (a.get("debian") or {}).get("packages") or {}
    pb = (b.get("debian") or {}).get("packages") or {}
    for name in sorted(set(pa) | set(pb)):
        if pa.get(name) != pb.get(name):
            out.append(f"deb {name}: {pa.get(name, '-')} -> {pb.get(name, '-')}")
    wa = {i["name"]: i["version"] for i in a.get("pip") or []}
    wb = {i["name"]: i["version"] for i in b.get("pip") or []}
    for name in sorted(set(wa) | set(wb)):
        if wa.get(name) != wb.get(name):
            out.append(f"pip {name}: {wa.get(name, '-')} -> {wb.get(name, '-')}")
    for key in ("kernel", "image"):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {json.dumps(a.get(key))} -> {json.dumps(b.get(key))}")
    return out

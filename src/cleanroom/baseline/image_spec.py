"""``cleanroom baseline build --image REF``: the one-line spec of an image used as it is."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from cleanroom.baseline.oci import check_ref
from cleanroom.errors import SpecError
from cleanroom.host.paths import cache_dir

LOCAL = ("oci-archive:", "docker-archive:", "oci:")


def _absolute(ref: str) -> str:
    """``ref`` with a local path made absolute (the spec lives elsewhere)."""
    for scheme in LOCAL:
        if ref.startswith(scheme):
            rest = ref.removeprefix(scheme)
            path, sep, tag = rest.partition(":") if scheme == "oci:" else (rest, "", "")
            return f"{scheme}{Path(path).resolve()}{sep}{tag}"
    return ref


def _name(ref: str) -> str:
    tail = re.split(r"[/:@]", ref.rstrip("/"))
    base = next((t for t in reversed(tail) if t and not t.startswith("sha256")), "image")
    name = re.sub(r"[^a-z0-9._-]", "-", base.lower()).strip("-._") or "image"
    return ("image-" + name)[:63]


def spec_for_image(ref: str) -> Path:
    """Write (once) and return a spec whose base is ``ref`` and whose entrypoint is the image's."""
    try:
        ref = _absolute(check_ref(ref))
    except ValueError as exc:
        raise SpecError(f"--image: {exc}") from exc
    folder = cache_dir() / "image-specs" / hashlib.sha256(ref.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "baseline.toml"
    escaped = ref.replace("\\", "\\\\").replace('"', '\\"')
    spec.write_text(f'name = "{_name(ref)}"\n\n[base]\nimage = "{escaped}"\n')
    return spec

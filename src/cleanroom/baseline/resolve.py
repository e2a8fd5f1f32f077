"""A baseline reference that may still need building: the one place above both store and builder."""

from __future__ import annotations

from pathlib import Path

from cleanroom.baseline.builder import build
from cleanroom.baseline.proc import Progress, quiet
from cleanroom.baseline.store import resolve, spec_file
from cleanroom.core.baseline_model import Baseline


def resolve_or_build(ref: str, progress: Progress = quiet) -> Baseline:
    """Like ``store.resolve``, but a spec (file or folder) that was not built yet is built now."""
    spec = spec_file(ref)
    if spec is not None and spec.is_file():
        return build(spec, progress=progress)
    return resolve(ref)


def resolve_baseline(baseline: Baseline | str | Path) -> Baseline:
    """A ``Baseline`` as given, or the one a path names (a baseline.toml or its folder,
    built first if its digest is not in the home's store yet)."""
    return baseline if isinstance(baseline, Baseline) else resolve_or_build(str(baseline))

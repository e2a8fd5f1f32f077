"""The run's baseline as a node finds it: by digest, verified before the node's first episode.

A node looks in its own baseline store (``CLEANROOM_HOME``), then at the driver's baseline
folder if it can see it (a shared file system, or the same host), then imports the archive the
driver put in the run's store (``baseline_share``: only once a node asked for it), then builds
the run's spec if the node has that file. Whatever it found must carry the run's digest and
re-hash clean: a node whose build came out different refuses the run and says which digest it
got.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cleanroom.baseline import store as baseline_store
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import METADATA_FILE as METADATA
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import BaselineError, BaselineNotFound, DriftError
from cleanroom.host.paths import baselines_dir
from cleanroom.integrations.ray import baseline_share
from cleanroom.store import Store


@dataclass(frozen=True)
class BaselineRef:
    """What a node is told about the run's baseline: its digest, the driver's folder of it,
    the spec it was built from (a path, if the run named one) and its archive in the run's
    store (once the driver put it there)."""

    digest: str
    folder: str | None = None
    spec: str | None = None
    archive: str | None = None

    @classmethod
    def of(cls, baseline: Baseline, source: str | None = None) -> BaselineRef:
        spec = source if source and source.endswith(".toml") else None
        return cls(baseline.digest, str(baseline.path), str(Path(spec).resolve()) if spec else None)


def resolve_on_node(ref: BaselineRef, node: str, store: Store | None = None) -> Baseline:
    """The baseline ``ref`` names, found, imported (from ``store``) or built on this node and
    re-hashed; BaselineError if what the node has differs, BaselineNotFound if it has no way
    to get it."""
    baseline = _find(ref, node, store)
    if baseline.digest != ref.digest:
        raise BaselineError(
            f"node {node}: the run's baseline is {ref.digest}, but this node's build of "
            f"{ref.spec or ref.folder} is {baseline.digest}: refusing (build it the same way on "
            "every node, or `cleanroom baseline export` it and import it here)"
        )
    baseline_store.require_intact(baseline, reuse=True)
    return baseline


def _find(ref: BaselineRef, node: str, store: Store | None) -> Baseline:
    try:
        return baseline_store.load(ref.digest)
    except BaselineNotFound:
        pass
    if ref.folder and (Path(ref.folder) / METADATA).is_file():
        folder = Path(ref.folder)
        try:
            found = Baseline.from_json(folder, json.loads((folder / METADATA).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DriftError(ref.digest, [METADATA]) from exc
        return found
    if ref.archive and store is not None:
        return baseline_share.fetch(store, ref.archive, ref.digest)
    if ref.spec and Path(ref.spec).is_file():
        return resolve_or_build(ref.spec)
    raise BaselineNotFound(
        f"node {node}: no baseline {ref.digest} here (not in {baselines_dir()}, "
        f"no folder {ref.folder}, no spec {ref.spec}, no archive in the run's store)"
    )

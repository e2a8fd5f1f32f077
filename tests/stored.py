"""Reading an episode's evidence as a reader must: through its record (the winning attempt's
files under ``attempts/<n>/``, ``store.layout``), never by a fixed path."""

from __future__ import annotations

import json
from pathlib import Path

from cleanroom.store import Store
from cleanroom.store.layout import Kind, listed


def evidence(folder: Path, kind: Kind, name: str) -> Path:
    """The file ``kind/name`` the record in the local episode ``folder`` lists."""
    record = json.loads((folder / "result.json").read_text())
    rel = listed(record, kind, name)
    assert rel is not None, f"{folder}: the record lists no {kind} {name!r}"
    return folder / rel


def evidence_bytes(store: Store, run_id: str, episode_id: str, kind: Kind, name: str) -> bytes:
    """The bytes of ``kind/name`` as the episode's record lists them, from any store."""
    record = store.get_record(run_id, episode_id)
    assert record is not None, f"{run_id}/{episode_id}: no record"
    rel = listed(record, kind, name)
    assert rel is not None, f"{run_id}/{episode_id}: the record lists no {kind} {name!r}"
    data = store.get_bytes(run_id, episode_id, rel)
    assert data is not None, f"{run_id}/{episode_id}: {rel} is listed but absent"
    return data

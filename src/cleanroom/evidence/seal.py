"""Seal a run: its ledger chain and the chain's signed head, written to the store.

``ledger/events.jsonl`` (the run's events, ``ledger.chain``) and ``ledger/head.dsse.json``
(a signed ``CHAIN`` statement over that file: how many events, the last one's hash) in the
run's folder of the store, beside ``episodes/``. Written when a run ends (every ``Episode``
registers ``seal_or_alert`` with ``Ledger.on_run_finished``: a batch's end, the last holder of
a session's run) and by ``cleanroom reap`` for a run whose controller died; a resumed run is
sealed again, its longer chain replacing the shorter (the head names its count; an older head
is a prefix).

A Ray run has one chain per node (each node's ledger is the truth about its VMs) besides the
driver's aggregate: a node seals its part of the run at ``ledger/nodes/<node>/`` when the run
closes there (or when its reaper touches the run), and the driver records each node's sealed
head in its own chain (``node_chain``) before sealing that at ``ledger/``; ``audit verify``
follows those links. A run is a node's part when its chain holds a ``node_run`` event.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cleanroom.errors import CleanroomError, EvidenceError
from cleanroom.evidence import attest, keys
from cleanroom.evidence.statements import chain_statement
from cleanroom.ledger import Ledger, chain
from cleanroom.store import StoredFile

CHAIN_EVENTS = "ledger/events.jsonl"
CHAIN_HEAD = "ledger/head.dsse.json"
NODE_RUN = "node_run"  # this ledger holds a Ray node's part of the run (data: node)
NODE_CHAIN = "node_chain"  # the driver's: a node sealed its part (data: node, events, head)


class Scope(enum.Enum):
    """Where ``seal_run`` puts a chain when not told: a node's part if the chain says so."""

    AUTO = "auto"


def chain_paths(node: str | None) -> tuple[str, str]:
    """(events, head) of the run's own chain, or of ``node``'s part of it."""
    if node is None:
        return CHAIN_EVENTS, CHAIN_HEAD
    return f"ledger/nodes/{node}/events.jsonl", f"ledger/nodes/{node}/head.dsse.json"


def node_of(events: list[dict[str, Any]]) -> str | None:
    """The node whose part of a run ``events`` are (its last ``node_run``), if any."""
    named = [json.loads(e["data"]).get("node") for e in events if e["kind"] == NODE_RUN]
    return str(named[-1]) if named and named[-1] else None


@runtime_checkable
class RunFiles(Protocol):
    """A store that keeps run-level files (every ``BaseStore``)."""

    def put_run_bytes(self, run_id: str, rel: str, data: bytes) -> StoredFile: ...
    def get_run_bytes(self, run_id: str, rel: str) -> bytes | None: ...


def seal_run(
    ledger: Ledger,
    store: object,
    run_id: str,
    signing_key: Path | None = None,
    node: str | Scope | None = Scope.AUTO,
) -> tuple[int, str | None]:
    """Export and sign ``run_id``'s chain (``node``: as that node's part; None: the run's
    own; AUTO: as the chain says); (events, head hash). Raises StoreError (the write),
    EvidenceError (the key), LedgerError; a store without run-level files is an EvidenceError."""
    if not isinstance(store, RunFiles):
        raise EvidenceError(f"the store {store!r} cannot keep a run's ledger chain")
    events = ledger.chain(run_id)
    part = node_of(events) if node is Scope.AUTO else node
    events_path, head_path = chain_paths(part)
    raw = chain.exported(events)
    head = events[-1]["hash"] if events else None
    stmt = chain_statement(run_id, events_path, raw, len(events), head, node=part)
    envelope = attest.sign(stmt, keys.signing_key(signing_key))
    store.put_run_bytes(run_id, events_path, raw)
    store.put_run_bytes(run_id, head_path, envelope)
    return len(events), head


def seal_or_alert(
    ledger: Ledger,
    store: object,
    run_id: str,
    signing_key: Path | None,
    emit: Callable[..., None],
    node: str | Scope | None = Scope.AUTO,
) -> tuple[int, str | None] | None:
    """``seal_run`` at a run's end, where a failure must not end anything else: it is
    recorded (``chain_seal_failed``) and alerted, and ``cleanroom audit seal`` can do it later.
    (events, head) as sealed, None if it failed."""
    try:
        return seal_run(ledger, store, run_id, signing_key, node)
    except CleanroomError as exc:
        with contextlib.suppress(CleanroomError):
            ledger.event("chain_seal_failed", run_id=run_id, error=str(exc))
        emit("alert", message=f"cannot seal the ledger chain of run {run_id}: {exc}")
        return None

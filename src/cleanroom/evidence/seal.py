"""Seal a run: its ledger chain and the chain's signed head, written to the store.

``ledger/events.jsonl`` (the run's events, ``ledger.chain``) and ``ledger/head.dsse.json``
(a signed ``CHAIN`` statement over that file: how many events, the last one's hash) in the
run's folder of the store, beside ``episodes/``. Written when a run ends (every ``Episode``
registers ``seal_or_alert`` with ``Ledger.on_run_finished``: a batch's end, the last holder of
a session's run) and by ``cleanroom reap`` for a run whose controller died; a resumed run is
sealed again, its longer chain replacing the shorter (the head names its count; an older head
is a prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from cleanroom.errors import CleanroomError, EvidenceError
from cleanroom.evidence import attest, keys
from cleanroom.evidence.statements import chain_statement
from cleanroom.ledger import Ledger, chain
from cleanroom.store import StoredFile

CHAIN_EVENTS = "ledger/events.jsonl"
CHAIN_HEAD = "ledger/head.dsse.json"


@runtime_checkable
class RunFiles(Protocol):
    """A store that keeps run-level files (every ``BaseStore``)."""

    def put_run_bytes(self, run_id: str, rel: str, data: bytes) -> StoredFile: ...
    def get_run_bytes(self, run_id: str, rel: str) -> bytes | None: ...


def seal_run(
    ledger: Ledger, store: object, run_id: str, signing_key: Path | None = None
) -> tuple[int, str | None]:
    """Export and sign ``run_id``'s chain; (events, head hash). Raises StoreError (the write),
    EvidenceError (the key), LedgerError; a store without run-level files is an EvidenceError."""
    if not isinstance(store, RunFiles):
        raise EvidenceError(f"the store {store!r} cannot keep a run's ledger chain")
    events = ledger.chain(run_id)
    raw = chain.exported(events)
    head = events[-1]["hash"] if events else None
    stmt = chain_statement(run_id, CHAIN_EVENTS, raw, len(events), head)
    envelope = attest.sign(stmt, keys.signing_key(signing_key))
    store.put_run_bytes(run_id, CHAIN_EVENTS, raw)
    store.put_run_bytes(run_id, CHAIN_HEAD, envelope)
    return len(events), head


def seal_or_alert(
    ledger: Ledger,
    store: object,
    run_id: str,
    signing_key: Path | None,
    emit: Callable[..., None],
) -> bool:
    """``seal_run`` at a run's end, where a failure must not end anything else: it is
    recorded (``chain_seal_failed``) and alerted, and ``cleanroom audit seal`` can do it later."""
    try:
        seal_run(ledger, store, run_id, signing_key)
    except CleanroomError as exc:
        with contextlib.suppress(CleanroomError):
            ledger.event("chain_seal_failed", run_id=run_id, error=str(exc))
        emit("alert", message=f"cannot seal the ledger chain of run {run_id}: {exc}")
        return False
    return True

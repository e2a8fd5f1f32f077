"""The report's evidence section: ``audit verify`` of the run (``checks.audit``) with this
home's public key, and each episode's verification status."""

from __future__ import annotations

from html import escape

from cleanroom.checks.audit import AuditReport, verify_run
from cleanroom.errors import CleanroomError
from cleanroom.evidence import keys
from cleanroom.store import Store


def audit(run_id: str, store: Store | None) -> AuditReport | str:
    """The run's audit, or why it could not be made (no store, no key of this home)."""
    if store is None:
        return "no store"
    path = keys.signing_key_path()
    if not path.exists():
        return f"no signing key at {path}"
    try:
        return verify_run(store, run_id, [keys.load_private(path).public_key()])
    except CleanroomError as exc:
        return str(exc)


def evidence(run_id: str, store: Store | None) -> str:
    """The section: the run's verdict, the first broken link, one row per episode."""
    found = audit(run_id, store)
    if isinstance(found, str):
        return f"<h2>Evidence</h2><p>not verified: {escape(found)}</p>"
    verdict = (
        "<span class='ok'>verified</span>: every signature, digest and chain link holds"
        if found.ok
        else f"<span class='bad'>BROKEN</span>: {escape(found.problems[0])}"
    )
    counts = f"{found.records} signed records, {found.envs} envs, {found.events} chained events"
    rows = "".join(
        f"<tr><td>{escape(eid)}</td><td class='{'ok' if s == 'verified' else 'bad'}'>"
        f"{escape(s)}</td></tr>"
        for eid, s in sorted(found.status.items())
    )
    return (
        f"<h2>Evidence</h2><p>{verdict} ({counts}; <code>cleanroom audit verify "
        f"{escape(run_id)}</code>)</p><table id='evidence'><tr><th>episode</th>"
        f"<th>verification</th></tr>{rows}</table>"
    )

"""``cleanroom check isolation``: measure that nothing of one episode reaches the next.

The check drives envs through the driver directly (create, PUT the canary script, exec it), so
it works with any baseline that has ``python3``. In each variant, env A *plants* canaries named
by a fresh token (see ``canary.py``: files under ``/``, ``/root``, ``/tmp``,
``/var/tmp``, pip and Hugging Face caches, a changed ``/etc/hosts``, variables persisted in
``/etc/environment`` and ``/root/.profile``, a background process that outlives its
entrypoint, sysctl changes) and records 32 random bytes and its boot id; env B *probes* for
them. A also probes itself: a canary A cannot see proves nothing about B (``BLIND``).

Variants: ``sequential`` (B after A is destroyed), ``concurrent`` (B while A and its background
process are alive), ``recovery`` (A's controller is SIGKILLed mid-episode, the restart reaps,
then B). A host-side audit then lists anything left of the check's envs (processes carrying an
env marker or a canary token, run folders, sockets, files naming a token) and removes it.

Cells: ``PASS`` (not visible to B / values differ), ``FAIL`` (leak), ``BLIND``, ``SKIP`` (could
not be planted here, e.g. a sysctl the kernel lacks), ``ERROR`` (the variant did not finish).
``IsolationReport.ok`` holds when no cell is FAIL, BLIND or ERROR and the audit is clean.
"""

from cleanroom.checks.isolation.cells import (
    CLEANUP,
    ROWS,
    VARIANTS,
    Cell,
    IsolationReport,
    Variant,
    evaluate,
)
from cleanroom.checks.isolation.check import IsolationCheck
from cleanroom.checks.isolation.plant import run_canary

__all__ = [
    "CLEANUP",
    "ROWS",
    "VARIANTS",
    "Cell",
    "IsolationCheck",
    "IsolationReport",
    "Variant",
    "evaluate",
    "run_canary",
]

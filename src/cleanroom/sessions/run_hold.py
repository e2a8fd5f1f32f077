"""A session's run row, finished once the session and every branch forked from it have ended."""

from __future__ import annotations

from cleanroom.ledger import Ledger


class RunHold:
    """Who still uses a session's run: the session itself and its open branches. The run is
    finished in the ledger when the last lets go (``failed`` if any of them failed)."""

    def __init__(self, ledger: Ledger, run_id: str) -> None:
        self.ledger, self.run_id = ledger, run_id
        self.holders = 0
        self.failed = False

    def take(self) -> None:
        self.holders += 1

    def let_go(self, ok: bool) -> None:
        self.holders -= 1
        self.failed = self.failed or not ok
        if self.holders == 0:
            self.ledger.finish_run(self.run_id, "failed" if self.failed else "completed")

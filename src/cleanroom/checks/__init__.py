"""Checks anyone can run over a run's evidence: ``audit`` (verify a run's attestations and
ledger chain, on any copy of its store) and ``replay`` (run a session's transcript again)."""

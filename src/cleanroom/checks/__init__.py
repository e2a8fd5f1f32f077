"""Checks a person runs: ``isolation`` (nothing crosses between episodes), ``repro`` (the same
manifest twice), ``doctor`` (what this host lacks), and over a run's evidence ``audit`` (verify
its attestations and ledger chain, on any copy of its store) and ``replay`` (run a session's
transcript again)."""

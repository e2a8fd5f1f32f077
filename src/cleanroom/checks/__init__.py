"""Checks a person runs: isolation, repro, doctor (and the evidence audit)."""

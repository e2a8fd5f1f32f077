"""Baselines: build, store, verify."""

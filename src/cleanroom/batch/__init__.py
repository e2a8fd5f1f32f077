"""Batches: many manifests, ``parallel`` at a time, each an ``Episode`` (``cleanroom.lifecycle``).

``runner`` (``Controller.run``: the run's lock, its queue, its spares), ``preflight`` (refusals
and reaping before any env), ``groups`` and ``warm_parent`` (episodes sharing one setup),
``result`` (what a run returns).
"""

"""Old import path of ``EpisodeClock`` (``cleanroom.lifecycle.clock``), kept for ``export.py``."""

from cleanroom.lifecycle.clock import EpisodeClock

__all__ = ["EpisodeClock"]

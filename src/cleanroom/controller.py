"""The controller's public import path (``from cleanroom.controller import Controller``): the
batch runner lives in ``cleanroom.batch``, an episode's lifecycle in ``cleanroom.lifecycle``."""

from cleanroom.batch.result import EpisodeResult, RunResult
from cleanroom.batch.runner import Controller, CreateEnv, EventHook, RunOptions, new_run_id

__all__ = [
    "Controller",
    "CreateEnv",
    "EpisodeResult",
    "EventHook",
    "RunOptions",
    "RunResult",
    "new_run_id",
]

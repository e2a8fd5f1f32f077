"""An episode's states, its ``Outcome`` and the one map from an exception to an outcome.

``Outcome`` is defined here, at the bottom (records, the ledger and the drivers all name it);
everything that decides an outcome from an exception calls ``classify``. ``Outcome.SUPERSEDED``
is the one outcome no exception maps to: an attempt whose export found another attempt's durable
record (``RecordConflict``: a retry on another node of a cluster run won the race) ends so, never
``export_failed``; the store's first-writer-wins kept the winner's record and files.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import traceback
from dataclasses import dataclass

from cleanroom.errors import CleanroomError, EnvCrashed, LaunchError, ProtocolError


class Outcome(enum.StrEnum):
    """How an episode attempt ended (one per attempt); the verdict is separate."""

    COMPLETED = "completed"
    EPISODE_ERROR = "episode_error"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    ENV_CRASHED = "env_crashed"
    INFRA_ERROR = "infra_error"
    EXPORT_FAILED = "export_failed"
    SUPERSEDED = "superseded"  # lost the race to another attempt's durable record (a cluster)

    @property
    def final(self) -> bool:
        """Does this outcome end the episode for good (a durable record is written)?"""
        return self in (Outcome.COMPLETED, Outcome.EPISODE_ERROR, Outcome.TIMEOUT)


__all__ = ["EpisodeState", "Failure", "Outcome", "classify"]

CANCELLED = "cancelled by the controller (Ctrl-C or SIGTERM)"


class EpisodeState(enum.StrEnum):
    """Where an episode attempt is (the ledger's ``episodes.state``), in order."""

    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    COLLECTING = "COLLECTING"
    VERIFYING = "VERIFYING"
    DURABLE = "DURABLE"
    DESTROYING = "DESTROYING"
    CLOSED = "CLOSED"


@dataclass(frozen=True)
class Failure:
    """How an exception ends an episode: its outcome, the message for the ledger and the
    record, and (for an exception nothing expected) its traceback, kept with the attempt."""

    outcome: Outcome
    error: str
    traceback: str | None = None


def classify(exc: BaseException, *, in_guest: bool = False) -> Failure:
    """The outcome of an episode that ``exc`` ended. ``in_guest``: raised while the guest was
    answering its RUN, where a dead env is ``env_crashed`` and a guest that breaks the protocol
    or its quota, or names a file too long for the host, is the guest's ``episode_error``.
    Anything else is ``infra_error``; one nothing expected keeps its traceback."""
    if isinstance(exc, asyncio.CancelledError):
        return Failure(Outcome.CANCELLED, CANCELLED)
    if in_guest:
        if isinstance(exc, EnvCrashed):
            return Failure(Outcome.ENV_CRASHED, str(exc))
        if isinstance(exc, ProtocolError):
            return Failure(Outcome.EPISODE_ERROR, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:  # a guest-chosen name
            return Failure(Outcome.EPISODE_ERROR, f"a name from the guest is too long: {exc}")
    if isinstance(exc, LaunchError):
        return Failure(Outcome.INFRA_ERROR, f"launch failed: {exc}")
    if isinstance(exc, CleanroomError):
        return Failure(Outcome.INFRA_ERROR, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, OSError):
        return Failure(Outcome.INFRA_ERROR, f"host error: {exc}")
    trace = "".join(traceback.format_exception(exc))
    return Failure(Outcome.INFRA_ERROR, f"unexpected {type(exc).__name__}: {exc}", trace)

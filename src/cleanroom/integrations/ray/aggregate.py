"""The run's aggregate in the driver's ledger: each attempt's end, as the scheduler saw it.

The nodes' ledgers are the truth about their VMs; this one says which attempt of each episode
ran where and how it ended (``infra_error`` for an attempt whose node died with nothing durable,
``superseded`` for one that lost to another attempt's record), so ``status``, ``report`` and
``inspect`` read a cluster run as they read a local one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cleanroom.batch.result import EpisodeResult
from cleanroom.core.states import Outcome
from cleanroom.errors import CleanroomError, ConfigError
from cleanroom.integrations.ray.pool import Node
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.verify import verdict_label
from cleanroom.store import Store

NODE_LOST = "node {node} lost: {error}"
Emit = Callable[..., None]


class Aggregate:
    """Writes attempts' ends to the driver's ledger and tells the event hook."""

    def __init__(self, ledger: Ledger, store: Store, emit: Emit) -> None:
        self.ledger, self.store, self.emit = ledger, store, emit

    def node_lost(
        self, run_id: str, eid: str, attempt: int, node: Node, exc: Exception
    ) -> EpisodeResult | None:
        """The node died under this attempt: the durable record if one got out, else None
        (this attempt ends ``infra_error`` in the driver's ledger)."""
        if node.alive:
            node.alive = False
            self.ledger.event("node_lost", run_id=run_id, node=node.node_id, error=str(exc)[:500])
            self.emit("alert", message=f"node {node.node_id} lost: {type(exc).__name__}")
        record = self.store.get_record(run_id, eid)
        if record is not None:
            return from_record(record)
        error = NODE_LOST.format(node=node.node_id, error=type(exc).__name__)
        self.ledger.episode_finished(
            run_id, eid, attempt, outcome=Outcome.INFRA_ERROR.value, error=error
        )
        return None

    def finished(self, run_id: str, done: EpisodeResult) -> None:
        self.ledger.episode_queued(run_id, done.episode_id, done.attempt)  # a winner from before
        self.ledger.episode_finished(
            run_id,
            done.episode_id,
            done.attempt,
            outcome=done.outcome.value,
            reward=done.reward,
            error=done.error,
            verdict=verdict_label((done.record or {}).get("verdict")),
        )
        if done.outcome is Outcome.SUPERSEDED:
            self._take_the_record(run_id, done.episode_id)
        destroy = done.destroy
        self.emit(
            "episode_finished",
            episode_id=done.episode_id,
            attempt=done.attempt,
            outcome=done.outcome.value,
            reward=done.reward,
            error=done.error,
            cleanup_ms=destroy.elapsed_ms if destroy else None,
            confirmed_absent=destroy.confirmed_absent if destroy else None,
        )

    def _take_the_record(self, run_id: str, eid: str) -> None:
        """An attempt lost to a durable record: the winner's row takes that record's outcome
        (it may say ``infra_error``: its node was taken for lost before the record got out)."""
        record = self.store.get_record(run_id, eid)
        if record is None:
            return
        winner = from_record(record)
        self.ledger.episode_queued(run_id, eid, winner.attempt)
        self.ledger.episode_finished(
            run_id,
            eid,
            winner.attempt,
            outcome=winner.outcome.value,
            reward=winner.reward,
            error=winner.error,
            verdict=verdict_label(record.get("verdict")),
        )


def from_record(record: dict[str, Any]) -> EpisodeResult:
    """The result a durable record stands for (whichever attempt, on whichever node)."""
    error = (record.get("error") or {}).get("message")
    outcome = Outcome(record["outcome"])
    return EpisodeResult(
        record["episode_id"], record["attempt"], outcome, record.get("reward"), error, record
    )


def refusal(exc: BaseException) -> CleanroomError:
    """A node's refusal as the run's error: its own CleanroomError, or a ConfigError."""
    cause = cause_of(exc)
    return cause if isinstance(cause, CleanroomError) else ConfigError(f"a node failed: {cause}")


def cause_of(exc: BaseException) -> BaseException:
    """The node's own exception inside a Ray task error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc

"""The guest's result.json is untrusted: every malformed shape is an explained problem."""

from __future__ import annotations

import pytest

from cleanroom.core.states import Outcome
from cleanroom.evidence.record import parse_guest_result


def test_valid_result() -> None:
    r = parse_guest_result(b'{"reward": 3, "terminated": true, "info": {"steps": 9}}')
    assert (r.problem, r.reward, r.terminated, r.info) == (None, 3.0, True, {"steps": 9})


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (None, "no /run/cleanroom/result.json"),
        (b"{oops", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b'{"reward": "high"}', "finite number"),
        (b'{"reward": true}', "finite number"),
        (b'{"reward": NaN}', "NaN"),
        (b'{"reward": 1, "info": {"x": Infinity}}', "Infinity"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"reward": 1, "pad": "' + b"x" * (5 * 1024 * 1024) + b'"}', "larger than"),
    ],
)
def test_bad_results_are_explained(raw: bytes | None, why: str) -> None:
    result = parse_guest_result(raw)
    assert result.problem is not None and why in result.problem
    assert result.reward is None


def test_only_episode_decided_outcomes_are_final() -> None:
    assert {o for o in Outcome if o.final} == {
        Outcome.COMPLETED,
        Outcome.EPISODE_ERROR,
        Outcome.TIMEOUT,
    }


def test_a_result_is_read_defensively_field_by_field() -> None:
    """Protects: what the record takes from a guest's result.json: missing info/metrics are
    empty, a non-object one is kept under "value", a non-boolean terminated/truncated is
    unknown (None), never trusted as given."""
    got = parse_guest_result(b'{"reward": 1, "terminated": "yes", "truncated": 1}')
    assert (got.problem, got.reward, got.terminated, got.truncated) == (None, 1.0, None, None)
    assert (got.info, got.metrics) == ({}, {})
    got = parse_guest_result(b'{"reward": 0, "info": 5, "metrics": [1, 2], "truncated": true}')
    assert (got.info, got.metrics, got.truncated) == ({"value": 5}, {"value": [1, 2]}, True)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (None, "the entrypoint wrote no /run/cleanroom/result.json"),
        (b"[1]", "result.json must hold a JSON object"),
        (b'{"reward": "1"}', "result.json: 'reward' must be a finite number"),
        (b"{", "result.json is not valid JSON"),
    ],
)
def test_an_unusable_result_says_why_and_carries_nothing(raw: bytes | None, problem: str) -> None:
    """Protects: the reason the record gives for an unusable result.json, and that nothing of
    it is kept (no reward, empty info and metrics)."""
    got = parse_guest_result(raw)
    assert got.problem is not None and got.problem.startswith(problem), got.problem
    assert (got.reward, got.info, got.metrics) == (None, {}, {})

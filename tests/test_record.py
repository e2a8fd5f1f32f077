"""The guest's result.json is untrusted: every malformed shape is an explained problem."""

from __future__ import annotations

import pytest

from cleanroom.record import Outcome, parse_guest_result


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

"""The Python API as a training loop uses it, on the fake driver (real agent, real controller).

What it protects (issue 14 §3): plain dicts are manifests everywhere (``cleanroom.run`` raised
``AttributeError``), the sync ``run`` takes ``options``/``on_event`` like ``arun``, episodes come
back in input order (not completion order), and the helpers a loop wants exist.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

import cleanroom
from cleanroom.batch.runner import RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import ManifestError, StoreError

from .conftest import make_fake_baseline


@pytest.fixture
def baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Baseline:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    return make_fake_baseline(tmp_path)


def ep(eid: str, seed: int, **task: Any) -> dict[str, Any]:
    return {"episode_id": eid, "seed": seed, "policy": {"id": "p"}, "task": task}


def test_dicts_run_in_input_order_with_options_events_and_helpers(baseline: Baseline) -> None:
    events: list[str] = []
    items = [ep("slow", 2, mode="sleep", seconds=1.5), ep("fast", 4), ep("bad", 6, mode="fail")]
    result = cleanroom.run(
        items,
        baseline=baseline,
        driver="fake",
        options=RunOptions(parallel=3),
        on_event=lambda kind, data: events.append(kind),
    )
    assert [e.episode_id for e in result.episodes] == ["slow", "fast", "bad"]
    assert "run_started" in events and events.count("episode_finished") == 3
    assert result.rewards() == {"slow": 1.0, "fast": 2.0, "bad": None}
    assert result.record("fast")["reward"] == 2.0
    path = result.artifact_path("fast", "hello.txt")
    assert path.read_text().startswith("hello") and path.is_relative_to(Path(result_store()))
    with pytest.raises(StoreError, match=r"no artifact 'nope' \(it has hello.txt\)"):
        result.artifact_path("fast", "nope")
    with pytest.raises(StoreError, match="not in this run"):
        result.record("ghost")
    assert result.record("bad")["outcome"] == "episode_error"  # final, so durable


def result_store() -> str:
    from cleanroom.host import paths

    return str(paths.store_dir())


def test_a_resumed_run_still_finds_the_records_it_skipped(baseline: Baseline) -> None:
    first = cleanroom.run([ep("a", 2)], baseline=baseline, driver="fake", run_id="again")
    again = cleanroom.run(
        [ep("a", 2), ep("b", 4)], baseline=baseline, driver="fake", run_id=first.run_id
    )
    assert again.skipped == ["a"] and [e.episode_id for e in again.episodes] == ["b"]
    assert again.record("a")["reward"] == 1.0 and again.rewards() == {"b": 2.0}


def test_the_blocking_run_takes_exactly_what_arun_takes() -> None:
    """Protects: ``run`` is made from ``arun`` (``api.blocking``), not a hand-kept copy of its
    keywords: the same parameters and defaults (``help`` shows them), under its own name."""
    assert inspect.signature(cleanroom.run) == inspect.signature(cleanroom.arun)
    assert cleanroom.run.__name__ == "run" and "arun" in (cleanroom.run.__doc__ or "")
    assert not inspect.iscoroutinefunction(cleanroom.run)


def test_bad_dicts_are_refused_by_index_and_field(baseline: Baseline) -> None:
    with pytest.raises(ManifestError) as info:
        cleanroom.run([ep("a", 1), {"episode_id": "b", "seed": "2"}], baseline=baseline)
    assert info.value.problems == [
        "item 1: seed: Input should be a valid integer",
        "item 1: policy: Field required",
    ]


def test_group_takes_dicts_and_manifests_and_names_the_bad_one() -> None:
    made = cleanroom.group("g", ["true"], [ep("a", 1), cleanroom.Manifest(**ep("b", 2))])
    assert [m.group.id if m.group else None for m in made] == ["g", "g"]
    with pytest.raises(ManifestError, match="item 1: seed"):
        cleanroom.group("g", ["true"], [ep("a", 1), ep("b", -1)])


def test_every_public_name_loads() -> None:
    """``cleanroom.X`` for every name in ``__all__`` (a lazy export pointing at a module that
    moved would only fail when a user first touched it)."""
    import cleanroom

    for name in cleanroom.__all__:
        assert getattr(cleanroom, name) is not None, name

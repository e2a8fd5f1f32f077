"""``CleanroomEnv`` on the fake driver (the real Python guest agent, which serves GYM_* frames
until the native one does, and its gym process as host processes):
the Gymnasium contract and the episode contract, fast. The same on real VMs: test_gym_vm.py.

Protects issue 19: nothing boots in ``__init__``; ``close`` is idempotent; each reset is one
episode of the env's run whose record (return, length, seed) and transcript (the trajectory)
are durable and whose env is gone before the next; the same seed gives the same trajectory;
a failing in-VM env is a ``GymEnvError`` and an ``episode_error``, and the next reset works.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium", reason="gymnasium not installed (cleanroom[gym])")

import cleanroom.gym as cgym  # noqa: E402
from cleanroom.drivers.fake import FakeDriver  # noqa: E402
from cleanroom.errors import GymEnvError, GymError  # noqa: E402
from cleanroom.ledger import Ledger  # noqa: E402
from cleanroom.store import LocalStore  # noqa: E402

from ..conftest import make_fake_baseline  # noqa: E402
from .gymkit import assert_run_is_evidence, forget_spaces, play, transcript  # noqa: E402

CARTPOLE = "gymnasium.envs.classic_control.cartpole:CartPoleEnv"  # importable with python -I


def test_nothing_boots_before_a_reset_and_close_is_idempotent(tmp_path: Path) -> None:
    env = cgym.make("CartPole-v1", baseline=tmp_path / "no-such-baseline.toml", driver="fake")
    env.close()
    env.close()
    assert env.run_id == ""  # no run was ever started (a bad baseline path was never read)
    with pytest.raises(GymError, match="closed"):
        env.reset(seed=1)


def test_bad_arguments_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(GymError, match="env must be"):
        cgym.CleanroomEnv(tmp_path, env="")
    with pytest.raises(GymError, match="step_timeout_s"):
        cgym.CleanroomEnv(tmp_path, env="CartPole-v1", step_timeout_s=0)


def test_each_reset_is_an_episode_with_durable_evidence(tmp_path: Path) -> None:
    baseline = make_fake_baseline(tmp_path)
    store = LocalStore(tmp_path / "store")
    forget_spaces()
    env = cgym.CleanroomEnv(baseline, env=CARTPOLE, driver="fake", store=tmp_path / "store")
    try:
        with pytest.raises(GymError, match="before reset"):
            env.step(0)
        assert isinstance(env.action_space, gymnasium.spaces.Discrete)  # the probe episode
        first, first_return = play(env, 7, [0, 1] * 300)
        second, _ = play(env, 7, [0, 1] * 300)  # same seed, same actions: same trajectory
        third, _ = play(env, 8, [0, 1] * 300)
        with Ledger() as ledger:
            envs = ledger.envs(run_id=env.run_id)
        live = {e.episode_id for e in envs if e.confirmed_absent_at is None}
        # the episodes before the one the last reset left are gone; that one may be ending
        assert {"ep-000004"} <= live <= {"ep-000003", "ep-000004", "ep-000005"}
    finally:
        env.close()
    env.close()
    assert len(first) == len(second) and all(map(np.array_equal, first, second))
    assert not np.array_equal(first[0], third[0])
    records = assert_run_is_evidence(env, FakeDriver(), store, expected=4)
    probe, one, two, three = records
    assert probe["policy"]["id"] == "gym-probe" and one["policy"]["id"] == "gym"
    assert [r["outcome"] for r in records] == ["completed"] * 4
    assert one["reward"] == first_return == len(first) - 1  # CartPole: +1 a step
    assert one["seed"] == two["seed"] != three["seed"]  # the in-VM env's seed, from np_random
    info = one["info"]
    assert (info["length"], info["reset_seed"], info["terminated"]) == (len(first) - 1, 7, True)
    steps = [s for s in transcript(store, env.run_id, one["episode_id"]) if s["op"] == "gym_step"]
    assert [s["action"] for s in steps] == [0, 1] * (len(steps) // 2) + [0] * (len(steps) % 2)
    assert sum(s["reward"] for s in steps) == first_return


def test_a_failing_in_vm_env_ends_its_episode_and_the_next_reset_works(tmp_path: Path) -> None:
    baseline = make_fake_baseline(tmp_path)
    store = LocalStore(tmp_path / "store")
    env = cgym.CleanroomEnv(baseline, env=CARTPOLE, driver="fake", store=tmp_path / "store")
    try:
        env.action_space  # noqa: B018 - learned (a probe episode) before the first reset
        env.reset(seed=1)
        with pytest.raises(GymEnvError, match="AssertionError"):
            env.step(5)  # not in Discrete(2): CartPole asserts
        with pytest.raises(GymError, match="before reset"):
            env.step(0)  # that episode is over
        play(env, 2, [0, 0, 0])
    finally:
        env.close()
    records = assert_run_is_evidence(env, FakeDriver(), store, expected=3)
    assert [r["outcome"] for r in records] == ["completed", "episode_error", "completed"]
    failed = transcript(store, env.run_id, records[1]["episode_id"])
    assert failed[-1]["op"] == "gym_error" and "AssertionError" in failed[-1]["error"]


def _wait_for_env_row(run_id: str, episode_id: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with Ledger() as ledger:
            if any(e.episode_id == episode_id for e in ledger.envs(run_id=run_id)):
                return
        time.sleep(0.05)
    raise AssertionError(f"{episode_id} was never opened ahead")


def test_a_reset_takes_an_episode_opened_ahead_and_the_next_one_settles_the_last(
    tmp_path: Path,
) -> None:
    """A reset is one GYM_RESET: its episode's env was made (ledger intent) before the reset
    was called. The episode it leaves ends in the background, and is durable with its env
    confirmed absent once the next reset returns (the guarantee the docs state)."""
    store = LocalStore(tmp_path / "store")
    env = cgym.CleanroomEnv(
        make_fake_baseline(tmp_path), env=CARTPOLE, driver="fake", store=tmp_path / "store"
    )
    try:
        env.reset(seed=1)  # the first: opened now (nothing was ahead yet)
        env.step(0)
        _wait_for_env_row(env.run_id, "ep-000002")  # the next episode opens meanwhile
        called = time.time()
        _, info = env.reset(seed=2)
        second = info["episode_id"]
        env.step(1)
        _, info = env.reset(seed=3)
        with Ledger() as ledger:
            rows = {e.episode_id: e for e in ledger.envs(run_id=env.run_id)}
        assert rows[second].intent_at is not None and rows[second].intent_at < called
        assert rows["ep-000001"].confirmed_absent_at is not None  # settled by this reset
        assert store.get_record(env.run_id, "ep-000001") is not None
    finally:
        env.close()
    records = assert_run_is_evidence(env, FakeDriver(), store, expected=3)
    assert [r["info"]["reset_seed"] for r in records] == [1, 2, 3]  # each reset named its own
    assert [r["policy"]["id"] for r in records] == ["gym"] * 3  # no longer "gym-ahead"


def test_an_unknown_env_is_a_gym_env_error(tmp_path: Path) -> None:
    env = cgym.CleanroomEnv(make_fake_baseline(tmp_path), env="NoSuchEnv-v9", driver="fake")
    try:
        with pytest.raises(GymEnvError, match="NoSuchEnv"):
            env.reset(seed=0)
    finally:
        env.close()


def test_registered_under_the_cleanroom_namespace(tmp_path: Path) -> None:
    """``gymnasium.make("cleanroom/<id>")`` makes a CleanroomEnv of ``<id>`` (and passes the
    baseline and settings on); the module prefix form needs no import of cleanroom.gym."""
    baseline = make_fake_baseline(tmp_path)
    env = gymnasium.make("cleanroom/CartPole-v1", baseline=baseline, driver="fake")
    assert isinstance(env.unwrapped, cgym.CleanroomEnv)
    assert env.unwrapped.env_id == "CartPole-v1"
    env.close()
    again = gymnasium.make(
        "cleanroom.gym:cleanroom/MountainCar-v0", baseline=baseline, driver="fake"
    )
    assert again.unwrapped.env_id == "MountainCar-v0"  # type: ignore[attr-defined]
    again.close()


def _wrappers(env: Any) -> list[str]:
    names = []
    while isinstance(env, gymnasium.Wrapper):
        names.append(type(env).__name__)
        env = env.env
    return names


def test_make_wraps_as_for_the_native_id(tmp_path: Path) -> None:
    """Protects issue 36: ``gymnasium.make("cleanroom/CartPole-v1")`` gets the wrappers and
    spec the native id gets (the checker, order enforcing, a TimeLimit of the native
    ``max_episode_steps``), so a step before reset is Gymnasium's ResetNeeded and the outer
    TimeLimit truncates exactly where the native one does."""
    baseline = make_fake_baseline(tmp_path)
    native = gymnasium.make("CartPole-v1")
    ours = gymnasium.make("cleanroom/CartPole-v1", baseline=baseline, driver="fake")
    try:
        assert _wrappers(ours) == _wrappers(native)
        assert ours.spec is not None and native.spec is not None
        assert ours.spec.max_episode_steps == native.spec.max_episode_steps == 500
        assert ours.spec.reward_threshold == native.spec.reward_threshold
        with pytest.raises(gymnasium.error.ResetNeeded):
            ours.step(0)
        short = gymnasium.make(
            "cleanroom/CartPole-v1",
            baseline=baseline,
            driver="fake",
            max_episode_steps=3,
        )
        try:
            short.reset(seed=0)
            flags = [short.step(i % 2)[3] for i in range(3)]
            assert flags == [False, False, True]  # truncated by the host's TimeLimit at 3
        finally:
            short.close()
    finally:
        ours.close()
        native.close()


def test_render_rgb_array_returns_the_in_vm_frames(tmp_path: Path) -> None:
    """``render_mode="rgb_array"``: each reset and step brings the in-VM env's frame back in
    its answer; ``render()`` is that frame, as the native env draws it for the same state."""
    pytest.importorskip("pygame", reason="CartPole draws its frames with pygame")
    env = gymnasium.make(
        "cleanroom/CartPole-v1",
        baseline=make_fake_baseline(tmp_path),
        driver="fake",
        render_mode="rgb_array",
    )
    native = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    try:
        obs, _ = env.reset(seed=4)
        first = env.render()
        assert isinstance(first, np.ndarray) and first.shape == (400, 600, 3)
        assert first.dtype == np.uint8
        native.reset()
        native.unwrapped.state = np.array(obs, dtype=np.float64)  # type: ignore[attr-defined]
        assert np.array_equal(first, native.render())
        for _ in range(8):
            env.step(1)
        assert not np.array_equal(first, env.render())  # the cart moved
    finally:
        env.close()
        native.close()
    with pytest.raises(GymError, match="render_mode"):
        cgym.make("CartPole-v1", baseline=tmp_path, render_mode="human")


def _nothing_running(home: Path) -> None:
    runs = home / "run" / "fake"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
    assert not FakeDriver().list_owned()


def test_an_unknown_make_keyword_fails_cleanly_and_leaves_nothing(tmp_path: Path) -> None:
    """Protects issue 36: a keyword the native env does not take fails at ``make`` as for the
    native id, before anything starts; one only the guest refuses (a ``module:Class`` env)
    fails the first look at the spaces, and the env closes itself there: no spare, no run
    folder, no run left ``running``."""
    from cleanroom.host import paths

    baseline = make_fake_baseline(tmp_path)
    with pytest.raises(GymError, match="order_enforce"):
        gymnasium.make(
            "cleanroom/CartPole-v1", baseline=baseline, driver="fake", order_enforce=True
        )
    _nothing_running(paths.home())
    forget_spaces()
    env = cgym.CleanroomEnv(baseline, env=CARTPOLE, env_kwargs={"no_such": 1}, driver="fake")
    with pytest.raises(GymEnvError, match="no_such"):
        env.action_space  # noqa: B018 - the probe fails in the guest
    with pytest.raises(GymError, match="closed"):
        env.reset(seed=0)
    _nothing_running(paths.home())
    with Ledger() as ledger:
        run = ledger.get_run(env.run_id)
        assert run is not None and run.status == "failed"


def test_a_closed_gym_run_is_completed_and_warns_of_nothing(tmp_path: Path) -> None:
    """Protects issue 36: the episode opened ahead and never used ends ``cancelled`` but is
    no failure of the run (``cleanroom runs`` says completed), and ``close`` leaves no unclosed
    stream or socket behind (no ResourceWarning)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        env = cgym.CleanroomEnv(make_fake_baseline(tmp_path), env=CARTPOLE, driver="fake")
        play(env, 1, [0, 1, 0])
        play(env, 2, [1, 0])
        env.close()
        run_id = env.run_id
        del env
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks
    with Ledger() as ledger:
        run = ledger.get_run(run_id)
        assert run is not None and run.status == "completed"


def test_a_lookahead_keeps_several_episodes_opened_ahead(tmp_path: Path) -> None:
    """``lookahead=3`` (episodes shorter than a VM's start, early in training): three
    episodes are open ahead of the one stepping, each reset takes the oldest, in order; at
    close the three unused end ``cancelled`` and the run is still ``completed``."""
    store = LocalStore(tmp_path / "store")
    env = cgym.CleanroomEnv(
        make_fake_baseline(tmp_path),
        env=CARTPOLE,
        driver="fake",
        store=tmp_path / "store",
        lookahead=3,
    )
    try:
        ids = [play(env, seed, [0, 1])[0] and env._episode.episode_id for seed in (1, 2)]  # type: ignore[union-attr]
        _wait_for_env_row(env.run_id, "ep-000005")  # the first, then three opened ahead
    finally:
        env.close()
    assert ids == ["ep-000001", "ep-000002"]
    records = assert_run_is_evidence(env, FakeDriver(), store, expected=2, ahead=3)
    assert [r["info"]["reset_seed"] for r in records] == [1, 2]
    with Ledger() as ledger:
        run = ledger.get_run(env.run_id)
        assert run is not None and run.status == "completed"
    for wrong in (-1, 9):  # 0 is allowed: nothing opened ahead (test_gym_async.py)
        with pytest.raises(GymError, match="lookahead"):
            cgym.CleanroomEnv(tmp_path, lookahead=wrong)

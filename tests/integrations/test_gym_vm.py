"""``cleanroom.gym`` on real QEMU microVMs of ``examples/gym`` (gymnasium's own CartPole-v1 in the
guest): Gymnasium's ``check_env``, same seed → same trajectory, vector envs (sync, async with fork
and spawn, NEXT_STEP autoreset), and a SIGKILLed worker leaving no VM for ``cleanroom reap``.

Protects issue 19 with real parts: the gym process in the template, one GYM_STEP round trip per
step, each reset a fresh clone opened ahead (its predecessor's end settled by the next reset or
close), every episode durable.
About 30 clones in all (one template build on a fresh machine).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium", reason="gymnasium not installed (cleanroom[gym])")

from gymnasium.utils.env_checker import check_env  # noqa: E402
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv  # noqa: E402

import cleanroom.gym as cgym  # noqa: E402
from cleanroom.core.baseline_model import Baseline  # noqa: E402
from cleanroom.drivers.qemu import QemuDriver  # noqa: E402
from cleanroom.ledger import Ledger  # noqa: E402
from cleanroom.store import LocalStore  # noqa: E402

from ..vmkit import assert_nothing_left  # noqa: E402
from .gymkit import assert_run_is_evidence, forget_spaces, play  # noqa: E402

pytestmark = pytest.mark.vm
SPEC = Path(__file__).resolve().parents[2] / "examples" / "gym" / "baseline.toml"


@pytest.fixture(scope="module")
def gym_baseline() -> Iterator[Baseline]:
    """The example's baseline (gymnasium + numpy from PyPI), built once and cached."""
    from cleanroom.baseline.resolve import resolve_or_build

    if sys.platform != "linux" or not os.path.exists("/usr/bin/qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed (run `make setup`)")
    yield resolve_or_build(str(SPEC), progress=lambda step, detail: print(step, detail))


def _make(baseline: str, store: str) -> cgym.CleanroomEnv:
    return cgym.make("CartPole-v1", baseline=baseline, store=store)


def test_check_env_and_the_same_seed_on_real_vms(gym_baseline: Baseline, tmp_path: Path) -> None:
    """Gymnasium's own checker passes (its resets are fresh VMs); two resets with one seed give
    one trajectory; every episode has its record and no VM outlives ``close``."""
    forget_spaces()
    store = LocalStore(tmp_path / "store")
    env = cgym.make("CartPole-v1", baseline=gym_baseline, store=tmp_path / "store")
    try:
        check_env(env, skip_render_check=True)
        actions = [0, 1, 1, 0, 1, 0, 0, 1] * 4
        first, first_return = play(env, 11, actions)
        second, _ = play(env, 11, actions)
        hello = env._episode._sb.episode.env.session.hello  # type: ignore[union-attr]
        assert hello["agent"] == "native" and "gym" in hello["features"]  # the example's
    finally:
        env.close()
    assert len(first) == len(second) > 5 and all(map(np.array_equal, first, second))
    with Ledger() as ledger:
        count = len(ledger.episodes(env.run_id))
    records = assert_run_is_evidence(env, QemuDriver(), store, expected=count - 1)
    assert records[0]["policy"]["id"] == "gym-probe"  # the spaces, learned before check_env
    assert all(r["outcome"] == "completed" for r in records)
    assert records[-2]["reward"] == first_return and records[-2]["seed"] == records[-1]["seed"]
    assert records[-1]["info"]["versions"]["gymnasium"] == gymnasium.__version__
    assert records[-1]["info"]["premade"] is True  # the template's env, not one made per reset


def _run_to_an_autoreset(vec: gymnasium.vector.VectorEnv) -> None:
    """Step with action 0 (CartPole falls in ~10 steps) until every sub-env has started a new
    episode through NEXT_STEP autoreset (a fresh VM each)."""
    _, info = vec.reset(seed=5)
    first = list(info["episode_id"])
    done = np.zeros(vec.num_envs, bool)
    renewed = np.zeros(vec.num_envs, bool)
    for _ in range(200):
        obs, _, terminated, truncated, info = vec.step(np.zeros(vec.num_envs, np.int64))
        assert obs.shape == (vec.num_envs, 4) and obs.dtype == np.float32
        if "episode_id" in info:  # a sub-env autoreset on this step: its new episode's id
            for i in np.flatnonzero(info["_episode_id"]):
                assert done[i] and info["episode_id"][i] != first[i]
                renewed[i] = True
        done |= terminated | truncated
        if renewed.all():
            return
    raise AssertionError(f"no autoreset in 200 steps: {renewed}")


def _assert_no_vm_left(since: float) -> None:
    with Ledger() as ledger:
        envs = [e for e in ledger.envs() if (e.intent_at or 0) >= since]
    assert envs and all(e.confirmed_absent_at is not None for e in envs), envs
    assert QemuDriver().list_owned() == []


def test_vector_envs_sync_and_async_spawn(gym_baseline: Baseline, tmp_path: Path) -> None:
    """SyncVectorEnv and AsyncVectorEnv (spawn: the env built from a pickled factory in a fresh
    interpreter, its loop and VMs made there) run CartPole through NEXT_STEP autoresets."""
    since = time.time()
    factory = functools.partial(_make, str(SPEC), str(tmp_path / "store"))
    sync = SyncVectorEnv([factory] * 2, autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        _run_to_an_autoreset(sync)
    finally:
        sync.close()
    spawned = AsyncVectorEnv([factory] * 2, context="spawn", autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        _run_to_an_autoreset(spawned)
    finally:
        spawned.close()
    _assert_no_vm_left(since)


def _wait_for_no_launch(run_id: str) -> None:
    """Until the run's live envs are all up, the episode opened ahead's included, so the kill
    lands on running VMs: the deadman this test checks. (A launcher forked just before the kill
    starts nothing: ``hostproc.supervised`` checks its parent once the signal is set.)"""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with Ledger() as ledger:
            live = [e for e in ledger.envs(run_id=run_id) if e.confirmed_absent_at is None]
        if len(live) >= 2 and all(e.state == "ready" for e in live):
            return
        time.sleep(0.1)
    raise AssertionError(f"the envs of {run_id} never settled: {live}")


def test_a_sigkilled_fork_worker_leaves_no_vm_and_reap_records_it(
    gym_baseline: Baseline, tmp_path: Path
) -> None:
    """AsyncVectorEnv with fork: the loop and VMs are made in each worker. A worker killed with
    SIGKILL takes its VMs with it (parent-death signal: no VM is left even before a reap), and
    ``cleanroom reap`` confirms them absent in the ledger and ends the episode it was running
    (the other worker, terminated by ``close(terminate=True)``, is reaped the same way)."""
    since = time.time()
    factory = functools.partial(_make, str(SPEC), str(tmp_path / "store"))
    vec = AsyncVectorEnv([factory] * 2, context="fork", autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        _run_to_an_autoreset(vec)
        _, info = vec.reset(seed=9)
        victim_run = str(info["run_id"][0])
        _wait_for_no_launch(victim_run)
        os.kill(vec.processes[0].pid, signal.SIGKILL)
        vec.processes[0].join(10)
    finally:
        vec.close(terminate=True)
    driver, deadline = QemuDriver(), time.monotonic() + 30
    with Ledger() as ledger:
        left = driver.list_owned()  # by cgroup and run folder: still there until a reap
        assert left
        while time.monotonic() < deadline and any(driver.alive(e) for e in left):
            time.sleep(0.2)  # the deadman: each VM dies with the worker that launched it
        assert not any(driver.alive(e) for e in left)
        unconfirmed = [e for e in ledger.envs(run_id=victim_run) if not e.confirmed_absent_at]
        assert unconfirmed  # the killed worker could not record its own VMs' end
    reap = subprocess.run(
        [sys.executable, "-m", "cleanroom", "reap"], capture_output=True, text=True, timeout=120
    )
    assert reap.returncode == 0, reap.stdout + reap.stderr
    with Ledger() as ledger:
        assert_nothing_left(QemuDriver(), ledger, victim_run)
        assert all(row.outcome is not None for row in ledger.episodes(victim_run))
    _assert_no_vm_left(since)


def test_make_wraps_renders_and_closes_cleanly_on_real_vms(
    gym_baseline: Baseline, tmp_path: Path
) -> None:
    """Issue 36 on real VMs: ``gymnasium.make("cleanroom/CartPole-v1")`` wraps as for the
    native id, ``render()`` gives the in-VM frames (pygame in the guest), ``close`` leaves no
    unclosed stream or socket, every VM gone and the run ``completed`` (not ``failed`` for
    the episode opened ahead and never used)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        env = gymnasium.make(
            "cleanroom/CartPole-v1",
            baseline=gym_baseline,
            store=tmp_path / "store",
            render_mode="rgb_array",
        )
        try:
            assert env.spec is not None and env.spec.max_episode_steps == 500
            assert type(env).__name__ == "TimeLimit"
            env.reset(seed=3)
            frame = env.render()
            assert isinstance(frame, np.ndarray) and frame.shape == (400, 600, 3)
            env.step(0)
        finally:
            env.close()
        run_id = env.unwrapped.run_id  # type: ignore[attr-defined]
        del env
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks
    with Ledger() as ledger:
        run = ledger.get_run(run_id)
        assert run is not None and run.status == "completed", run
    assert QemuDriver().list_owned() == []

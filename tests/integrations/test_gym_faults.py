"""A Gym episode whose guest fails is the guest's outcome: ``episode_error``, final, durable.

Protects issue 30: a step that never answers (the in-VM env hangs; here its gym process is
stopped) and an agent killed under the env ended the episode ``infra_error`` with no record
(the ``TimeoutError``/``EnvCrashed`` bypassed the session's guard). Now each is a
``GymEnvError`` to the caller, and the episode ends ``episode_error`` with its record and its
transcript saying why; the next reset works. The fake driver (the real C agent and its gym
process as host processes, which the test can stop or kill).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("gymnasium", reason="gymnasium not installed (cleanroom[gym])")

import cleanroom.gym as cgym
from cleanroom.agent import native
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import GymEnvError
from cleanroom.host import hostproc
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline
from .gymkit import assert_run_is_evidence, play, transcript

CARTPOLE = "gymnasium.envs.classic_control.cartpole:CartPoleEnv"


def _process(env: cgym.CleanroomEnv, needle: bytes) -> int:
    """The pid of the current episode's host process whose command line holds ``needle``."""
    episode = env._episode
    assert episode is not None and episode._sb is not None
    live = episode._sb.episode.env
    assert live is not None and live.info.pid is not None
    for pid in hostproc.descendants(live.info.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            return pid
    raise AssertionError(f"no process with {needle!r} under {live.info.pid}")


@pytest.mark.parametrize("fault", ["hang", "agent_killed"])
def test_a_guest_that_stops_answering_is_an_episode_error(tmp_path: Path, fault: str) -> None:
    store = LocalStore(tmp_path / "store")
    env = cgym.CleanroomEnv(
        make_fake_baseline(tmp_path),
        env=CARTPOLE,
        driver="fake",
        store=tmp_path / "store",
        # the hang is found by this timeout; a killed agent by its channel's end, long before
        step_timeout_s=3.0 if fault == "hang" else 60.0,
    )
    try:
        env.action_space  # noqa: B018 - learned (a probe episode) before the first reset
        env.reset(seed=1)
        env.step(0)
        if fault == "hang":  # the in-VM env's step never answers
            os.kill(_process(env, b"gym_worker"), signal.SIGSTOP)
            expected = r"no answer within 3.0s"
        else:  # the agent under the env is killed
            os.kill(_process(env, str(native.host_binary()).encode()), signal.SIGKILL)
            expected = r"agent is gone"
        with pytest.raises(GymEnvError, match=expected):
            env.step(1)
        play(env, 2, [0, 0, 0])  # the next reset works
    finally:
        env.close()
    records = assert_run_is_evidence(env, FakeDriver(), store, expected=3)
    assert [r["outcome"] for r in records] == ["completed", "episode_error", "completed"]
    failed = records[1]
    assert "GymEnvError" in failed["error"]["message"]
    said = transcript(store, env.run_id, failed["episode_id"])
    assert said[-1]["op"] == "gym_error" and "GymEnvError" in said[-1]["error"]

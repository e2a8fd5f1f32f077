"""The native agent's gym relay (``agent/native/gym.c``), run on the host: fast, no VM.

Protects issue 19: GYM_* frames (kinds 40-46) were unknown to the native agent, which ended
its channel on them. Now HELLO lists ``gym`` where the gym process can run (its files beside
the agent), each request reaches the gym process (started at the first one when the baseline
has no gym config) and its one answer comes back; a gym process that cannot start or cannot
make the env is a GYM_ERROR, and the agent goes on answering. The relay with a real env in a
real VM: tests/integrations/test_gym_vm.py (examples/gym runs the native agent).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.agent.test_native_agent import drive

from cleanroom.agent import gym_codec, native
from cleanroom.agent.connection import AgentConnection
from cleanroom.agent.protocol import Kind
from cleanroom.baseline.spec import AGENT_DIR, NATIVE_GYM_FILES
from cleanroom.gym import wire

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.fixture(scope="module")
def gym_agent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent with the gym process's files beside it, as a native gym baseline has them."""
    folder = tmp_path_factory.mktemp("native-gym")
    subprocess.run(native.gcc_argv(folder / native.BINARY), cwd=native.NATIVE_DIR, check=True)
    for name in NATIVE_GYM_FILES:
        shutil.copy(AGENT_DIR / name, folder / name)
    return folder / native.BINARY


def test_hello_lists_gym_only_where_the_gym_process_can_run(
    gym_agent: Path, tmp_path: Path
) -> None:
    async def body(session: AgentConnection) -> list[str]:
        return list(session.hello["features"])

    assert "gym" in drive(gym_agent, tmp_path, body)
    bare = tmp_path / "bare" / native.BINARY
    bare.parent.mkdir()
    shutil.copy(gym_agent, bare)
    assert "gym" not in drive(bare, tmp_path, body)


def test_a_gym_request_is_answered_and_the_agent_goes_on(gym_agent: Path, tmp_path: Path) -> None:
    """An env no module provides: GYM_ERROR (fatal if this host's python3 has no gymnasium,
    from the env's import if it has); a step with no env made is one too; PING still works."""
    node, action = gym_codec.encode(1)

    async def body(session: AgentConnection) -> tuple[Any, Any, float]:
        made = await session.request(Kind.GYM_MAKE, {"env": "no_such_module:Env", "kwargs": {}})
        step = await session.request(Kind.GYM_STEP, {"tree": node}, action)
        return made, step, await session.ping()

    made, step, ping = drive(gym_agent, tmp_path, body)
    assert made.kind == step.kind == Kind.GYM_ERROR
    assert made.header["message"] and step.header["message"]
    assert ping >= 0


def test_an_env_steps_through_the_relay(gym_agent: Path, tmp_path: Path) -> None:
    """With this interpreter as the gym process's Python (``CLEANROOM_PYTHON``, the fake
    driver's way), CartPole is made, reset and stepped through the C relay; every answer
    crosses the host's boundary (``cleanroom.gym.wire``) as it came from the gym process."""
    pytest.importorskip("gymnasium", reason="gymnasium not installed (cleanroom[gym])")
    cartpole = "gymnasium.envs.classic_control.cartpole:CartPoleEnv"
    node, action = gym_codec.encode(1)

    async def body(session: AgentConnection) -> tuple[Any, ...]:
        made = await session.request(Kind.GYM_MAKE, {"env": cartpole, "kwargs": {}})
        reset = await session.request(Kind.GYM_RESET, {"seed": 3, "options": None})
        step = await session.request(Kind.GYM_STEP, {"tree": node}, action)
        return made, reset, step

    made, reset, step = drive(gym_agent, tmp_path, body, {"CLEANROOM_PYTHON": sys.executable})
    observation, act, _ = wire.spaces_of(wire.value(made, Kind.GYM_SPACES))
    assert act.n == 2 and observation.shape == (4,)  # type: ignore[attr-defined]
    obs, _ = wire.reset(wire.value(reset, Kind.GYM_OBS))
    after, reward, terminated, truncated, _ = wire.step(step, wire.value(step, Kind.GYM_OBS))
    assert obs.shape == after.shape == (4,) and not (obs == after).all()
    assert (reward, terminated, truncated) == (1.0, False, False)

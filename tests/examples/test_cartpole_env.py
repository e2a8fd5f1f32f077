"""Host-side tests of the cartpole example's guest code (no VM: fast)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tomllib
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cartpole"
ENV_DIR = EXAMPLE / "env"
RUN_EPISODE = ENV_DIR / "run_episode.py"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"cartpole_example_{name}", ENV_DIR / f"{name}.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cartpole = _load("cartpole")
policies = _load("policies")


def _manifests() -> list[dict[str, Any]]:
    lines = (EXAMPLE / "manifests.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _episode(seed: int, policy_id: str, params: dict[str, Any]) -> tuple[float, bool, bool, int]:
    env = cartpole.CartPole()
    obs = env.reset(seed)
    policy = policies.make_policy(policy_id, params, seed)
    total, terminated, truncated = 0.0, False, False
    while not (terminated or truncated):
        obs, reward, terminated, truncated = env.step(policy(obs))
        total += reward
    return total, terminated, truncated, env.elapsed_steps


def _mean_returns() -> dict[str, float]:
    returns: dict[str, list[float]] = {}
    for m in _manifests():
        total = _episode(m["seed"], m["policy"]["id"], m["policy"]["params"])[0]
        returns.setdefault(m["policy"]["id"], []).append(total)
    return {pid: statistics.mean(values) for pid, values in returns.items()}


# --- physics ---------------------------------------------------------------------------------


def test_single_step_matches_hand_computation() -> None:
    # From rest, pushing right (F = +10 N): sin(theta) = 0, cos(theta) = 1, so
    #   temp     = F / (mc + mp)                          = 100/11
    #   thetaacc = -temp / (l * (4/3 - mp / (mc + mp)))   = -(100/11) / (41/66) = -600/41
    #   xacc     = temp - mp*l * thetaacc / (mc + mp)     = 100/11 + 300/451    = 4400/451
    # Explicit Euler moves positions with the OLD velocities (0) and velocities by tau * acc.
    x, x_dot, theta, theta_dot = cartpole.step_state((0.0, 0.0, 0.0, 0.0), 1)
    assert x == 0.0 and theta == 0.0
    assert x_dot == pytest.approx(float(Fraction(2, 100) * Fraction(4400, 451)), rel=1e-12)
    assert theta_dot == pytest.approx(float(Fraction(2, 100) * Fraction(-600, 41)), rel=1e-12)
    assert x_dot == pytest.approx(0.1951219512, rel=1e-9)
    assert theta_dot == pytest.approx(-0.2926829268, rel=1e-9)

    # Second step: positions advance by tau * the velocities of step one (explicit, not
    # semi-implicit, Euler).
    x2, _, theta2, _ = cartpole.step_state((x, x_dot, theta, theta_dot), 0)
    assert x2 == pytest.approx(0.02 * x_dot, rel=1e-12)
    assert theta2 == pytest.approx(0.02 * theta_dot, rel=1e-12)


def test_pushing_left_mirrors_pushing_right() -> None:
    state = (0.01, -0.02, 0.03, -0.04)
    mirrored = (-state[0], -state[1], -state[2], -state[3])
    right = cartpole.step_state(state, 1)
    left = cartpole.step_state(mirrored, 0)
    assert left == pytest.approx(tuple(-v for v in right), rel=1e-12, abs=1e-15)


def test_constants_and_thresholds() -> None:
    assert math.isclose(cartpole.THETA_THRESHOLD_RADIANS, math.radians(12))
    assert cartpole.is_terminal((2.41, 0.0, 0.0, 0.0))
    assert cartpole.is_terminal((0.0, 0.0, -0.21, 0.0))
    assert not cartpole.is_terminal((2.39, 5.0, 0.2, 5.0))


def test_reset_is_seeded_uniform_and_float32() -> None:
    env = cartpole.CartPole()
    obs = env.reset(7)
    assert obs != env.reset(8)
    assert obs == env.reset(7)
    assert all(-0.05 <= v <= 0.05 for v in obs)
    assert all(cartpole.to_float32(v) == v for v in obs)
    assert env.state is not None and obs == [cartpole.to_float32(v) for v in env.state]


def test_truncates_at_500_steps() -> None:
    total, terminated, truncated, steps = _episode(1, "angle", {"k": 0.5})
    assert (total, terminated, truncated, steps) == (500.0, False, True, 500)


def test_step_after_end_and_bad_action_raise() -> None:
    env = cartpole.CartPole(max_episode_steps=1)
    env.reset(0)
    with pytest.raises(ValueError):
        env.step(2)
    env.step(0)
    with pytest.raises(RuntimeError):
        env.step(0)


@pytest.mark.parametrize("policy_id", ["angle", "random"])
def test_matches_gymnasium_from_the_same_state(policy_id: str) -> None:
    """Only where Gymnasium is installed: bit-identical steps from the same initial state."""
    gym = pytest.importorskip("gymnasium")
    reference = gym.make("CartPole-v1")
    reference.reset(seed=0)
    ours = cartpole.CartPole()
    obs = ours.reset(3)
    reference.unwrapped.state = ours.state
    policy = policies.make_policy(policy_id, {}, 3)
    terminated = truncated = False
    while not (terminated or truncated):
        action = policy(obs)
        ref_obs, ref_reward, ref_term, ref_trunc, _ = reference.step(action)
        obs, reward, terminated, truncated = ours.step(action)
        assert [float(v) for v in ref_obs] == obs
        assert (ref_reward, ref_term, ref_trunc) == (reward, terminated, truncated)
    assert truncated == (policy_id == "angle")  # angle balances all 500 steps; random falls


# --- policies --------------------------------------------------------------------------------


def test_same_seed_and_policy_give_the_same_return() -> None:
    for m in _manifests():
        args = (m["seed"], m["policy"]["id"], m["policy"]["params"])
        assert _episode(*args) == _episode(*args)


def test_random_policy_differs_across_seeds() -> None:
    returns = {_episode(seed, "random", {})[0] for seed in range(8)}
    assert len(returns) > 1


def test_angle_policy_beats_random_over_the_manifests() -> None:
    means = _mean_returns()
    assert means["angle"] > means["random"]
    assert means["linear"] > means["random"]


@pytest.mark.parametrize(
    ("policy_id", "params"),
    [
        ("nope", {}),
        ("random", {"p_right": 2}),
        ("random", {"typo": 1}),
        ("angle", {"k": "big"}),
        ("angle", {"k": True}),
        ("linear", {"w": [1, 2, 3]}),
        ("linear", {"w": [1, 2, 3, float("nan")]}),
    ],
)
def test_bad_policies_are_refused(policy_id: str, params: dict[str, Any]) -> None:
    with pytest.raises(policies.PolicyError):
        policies.make_policy(policy_id, params, 0)


# --- the shipped files -----------------------------------------------------------------------


def test_manifests_file_shape() -> None:
    manifests = _manifests()
    assert len(manifests) == 16
    assert len({m["episode_id"] for m in manifests}) == 16
    assert len({m["policy"]["id"] for m in manifests}) >= 3
    assert len({m["seed"] for m in manifests}) > 4
    for m in manifests:
        assert set(m) == {"episode_id", "seed", "policy", "task", "limits"}
        assert set(m["policy"]) == {"id", "version", "params"}
        assert m["task"] == {"env": "CartPole-v1"}
        policies.make_policy(m["policy"]["id"], m["policy"]["params"], m["seed"])

    from cleanroom.evidence.manifest import parse_manifests

    assert len(parse_manifests((EXAMPLE / "manifests.jsonl").read_text())) == 16


def test_baseline_spec_points_at_the_entrypoint() -> None:
    spec = tomllib.loads((EXAMPLE / "baseline.toml").read_text())
    assert spec["name"] == "cartpole"
    assert spec["base"]["packages"] == ["python3-minimal"]
    (files,) = spec["files"]
    assert (EXAMPLE / files["src"]).is_dir()
    module, function = spec["entrypoint"]["function"].split(":")
    assert (EXAMPLE / files["src"] / f"{module}.py").is_file()
    assert module in spec["entrypoint"]["preimport"]
    assert callable(getattr(_load(module), function))


def test_the_function_entrypoint_returns_what_the_command_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _manifests()[5]
    proc = _run(tmp_path / "command", manifest)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((tmp_path / "command" / "result.json").read_text())
    monkeypatch.setenv("CLEANROOM_DIR", str(tmp_path / "function"))
    returned = _load("run_episode").episode(json.loads(json.dumps(manifest)))
    assert json.loads(json.dumps(returned)) == written
    trajectory = "out/trajectory.jsonl"
    assert (tmp_path / "function" / trajectory).read_bytes() == (
        tmp_path / "command" / trajectory
    ).read_bytes()
    with pytest.raises(Exception, match="seed"):
        _load("run_episode").episode({**manifest, "seed": -1})


# --- the entrypoint, as the guest runs it ----------------------------------------------------


def _run(
    tmp_path: Path, manifest: Any, *, raw: str | None = None
) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = raw if raw is not None else json.dumps(manifest)
    (tmp_path / "manifest.json").write_text(text)
    env = {**os.environ, "CLEANROOM_DIR": str(tmp_path)}
    argv = [sys.executable, str(RUN_EPISODE)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_run_episode_writes_result_and_trajectory(tmp_path: Path) -> None:
    manifest = _manifests()[1]
    proc = _run(tmp_path, manifest)
    assert proc.returncode == 0, proc.stderr
    assert manifest["episode_id"] in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result) >= {"reward", "terminated", "truncated", "info", "metrics"}
    assert result["info"]["policy"] == manifest["policy"]["id"]
    steps = [json.loads(line) for line in (tmp_path / "out" / "trajectory.jsonl").open()]
    assert len(steps) == result["info"]["steps"] > 0
    assert [s["t"] for s in steps] == list(range(len(steps)))
    assert all(set(s) == {"t", "obs", "action", "reward"} and len(s["obs"]) == 4 for s in steps)
    assert result["reward"] == sum(s["reward"] for s in steps)
    expected = _episode(manifest["seed"], manifest["policy"]["id"], manifest["policy"]["params"])
    assert (result["reward"], result["terminated"], result["truncated"]) == expected[:3]


def test_run_episode_is_deterministic(tmp_path: Path) -> None:
    manifest = _manifests()[0]
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for folder in runs:
        proc = _run(folder, manifest)
        assert proc.returncode == 0, proc.stderr
    for name in ("result.json", "out/trajectory.jsonl"):
        texts = {(folder / name).read_bytes() for folder in runs}
        assert len(texts) == 1, name


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        "[1, 2]",
        '{"episode_id": "x", "policy": {"id": "angle"}}',
        '{"episode_id": "x", "seed": -1, "policy": {"id": "angle"}}',
        '{"episode_id": "x", "seed": 1.5, "policy": {"id": "angle"}}',
        '{"episode_id": "x", "seed": 1}',
        '{"episode_id": "x", "seed": 1, "policy": {"id": "mystery"}}',
        '{"episode_id": "x", "seed": 1, "policy": {"id": "angle", "params": {"k": "x"}}}',
        '{"episode_id": "x", "seed": 1, "policy": {"id": "angle"}, "task": {"env": "Pong"}}',
    ],
)
def test_bad_manifest_exits_2(tmp_path: Path, raw: str) -> None:
    proc = _run(tmp_path, None, raw=raw)
    assert proc.returncode == 2
    assert "bad manifest" in proc.stderr
    assert not (tmp_path / "result.json").exists()


def test_missing_manifest_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "CLEANROOM_DIR": str(tmp_path / "absent")}
    proc = subprocess.run(
        [sys.executable, str(RUN_EPISODE)], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2

"""cleanroom entrypoint for the cartpole baseline: run one CartPole-v1 episode.

Reads ``$CLEANROOM_DIR/manifest.json`` (``CLEANROOM_DIR`` defaults to ``/run/cleanroom``), runs one
episode with the manifest's ``seed`` and ``policy`` (``id`` and ``params``, see policies.py),
writes the trajectory to ``$CLEANROOM_DIR/out/trajectory.jsonl`` (one line per step: ``t``,
``obs`` (the observation the action was chosen from), ``action``, ``reward``) and the result to
``$CLEANROOM_DIR/result.json``. Deterministic: the same seed and policy give the same result.

As a command (``python3 run_episode.py``), exit codes: 0 after an episode (whatever its
return), 2 for a bad manifest. As a function entrypoint (``run_episode:episode``, what the
baseline uses) the warm worker calls ``episode(manifest)`` and keeps its return value.
Needs only Python's standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cartpole import CartPole
from policies import PolicyError, make_policy


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


loads = json.loads

ENV_ID = "CartPole-v1"
EXIT_BAD_MANIFEST = 2


class ManifestError(Exception):
    """The manifest cannot drive an episode."""


def read_manifest(path: Path) -> dict[str, Any]:
    """Load and check the fields this entrypoint uses; raise ManifestError when unusable."""
    try:
        data = loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from exc
    return check_manifest(data)


def check_manifest(data: Any) -> dict[str, Any]:
    """The manifest, if it can drive an episode; else ManifestError."""
    if not isinstance(data, dict):
        raise ManifestError("the manifest must be a JSON object")
    seed = data.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ManifestError(f"'seed' must be a non-negative integer, got {seed!r}")
    policy = data.get("policy")
    if not isinstance(policy, dict) or not isinstance(policy.get("id"), str):
        raise ManifestError("'policy' must be an object with a string 'id'")
    task = data.get("task", {})
    if not isinstance(task, dict):
        raise ManifestError("'task' must be an object")
    if task.get("env", ENV_ID) != ENV_ID:
        raise ManifestError(f"this baseline runs {ENV_ID!r} only, not {task.get('env')!r}")
    return data


def run(manifest: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Run one episode, write its trajectory under ``out_dir``, return the result record."""
    seed: int = manifest["seed"]
    policy_spec: dict[str, Any] = manifest["policy"]
    policy = make_policy(policy_spec["id"], policy_spec.get("params"), seed)
    env = CartPole()
    obs = env.reset(seed)
    initial_obs = obs
    total = 0.0
    terminated = truncated = False
    max_abs_theta = max_abs_x = 0.0
    digest = hashlib.sha256()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "trajectory.jsonl", "w", encoding="utf-8") as trajectory:
        t = 0
        while not (terminated or truncated):
            action = policy(obs)
            next_obs, reward, terminated, truncated = env.step(action)
            line = dumps({"t": t, "obs": obs, "action": action, "reward": reward}) + "\n"
            trajectory.write(line)
            digest.update(line.encode())
            total += reward
            max_abs_x = max(max_abs_x, abs(next_obs[0]))
            max_abs_theta = max(max_abs_theta, abs(next_obs[2]))
            obs = next_obs
            t += 1
    return {
        "reward": total,
        "terminated": terminated,
        "truncated": truncated,
        "info": {"steps": env.elapsed_steps, "policy": policy_spec["id"], "env": ENV_ID},
        "metrics": {
            "initial_obs": initial_obs,
            "final_obs": obs,
            "max_abs_x": max_abs_x,
            "max_abs_theta": max_abs_theta,
            "trajectory_sha256": digest.hexdigest(),
        },
    }


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def episode(manifest: dict[str, Any]) -> dict[str, Any]:
    """The function entrypoint (``run_episode:episode``): the baseline's warm worker has this
    module imported already, calls this with the manifest, and keeps the return value as the
    result record. A bad manifest raises (the episode ends ``episode_error``)."""
    started = time.monotonic()
    manifest = check_manifest(manifest)
    root = Path(os.environ.get("CLEANROOM_DIR", "/run/cleanroom"))
    result = run(manifest, root / "out")
    print_summary(manifest, result, started)
    return result


def print_summary(manifest: dict[str, Any], result: dict[str, Any], started: float) -> None:
    print(
        f"cartpole {manifest.get('episode_id', '?')}: seed={manifest['seed']} "
        f"policy={result['info']['policy']} steps={result['info']['steps']} "
        f"return={result['reward']:g} terminated={result['terminated']} "
        f"truncated={result['truncated']} ({time.monotonic() - started:.2f}s)",
        flush=True,
    )


def main() -> int:
    """The command entrypoint: the same episode, from and to files under ``$CLEANROOM_DIR``."""
    root = Path(os.environ.get("CLEANROOM_DIR", "/run/cleanroom"))
    started = time.monotonic()
    try:
        manifest = read_manifest(root / "manifest.json")
        result = run(manifest, root / "out")
    except (ManifestError, PolicyError) as exc:
        print(f"cartpole: bad manifest: {exc}", file=sys.stderr)
        return EXIT_BAD_MANIFEST
    write_atomically(root / "result.json", dumps(result) + "\n")
    print_summary(manifest, result, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

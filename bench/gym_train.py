"""Training benchmark: a plain PPO loop (numpy) on ``cleanroom/CartPole-v1`` against native
``CartPole-v1``, in the same run, with the same seed and the same number of env steps.

stable-baselines3 needs torch (a ~700 MB wheel): this loop is PPO as SB3 runs it for CartPole
(rollouts of ``--rollout`` steps, GAE(0.98, 0.8), a clipped surrogate of 0.2, ``--epochs``
epochs of minibatches of 64), with a linear softmax policy and a linear value, gradients by hand.
What is measured, per side: the whole training's wall time, and where it went — the env's
``step`` calls, its ``reset`` calls (each a fresh VM for cleanroom), and the learner. The ratio
of the whole training is the number a user feels; the mean return of the last 10 episodes shows
both sides learned the same thing. Results: bench/results/gym_train.txt.

    python bench/gym_train.py [--steps 2048] [--rollout 512] [--lookahead 1,3] [--note "..."]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from stats import write

import cleanroom.gym  # noqa: F401 - registers cleanroom/<id>

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "gym" / "baseline.toml"
OUT = ROOT / "bench" / "results" / "gym_train.txt"
GAMMA, LAM, CLIP, LR, VLR, BATCH = 0.98, 0.8, 0.2, 1.0, 0.01, 64


@dataclass
class Clock:
    """Seconds spent in each part of a training run."""

    step: float = 0.0
    reset: float = 0.0
    learn: float = 0.0
    steps: int = 0
    episodes: int = 0
    returns: list[float] = field(default_factory=list)


class Policy:
    """A linear softmax policy and a linear value on the observation (and a bias)."""

    def __init__(self, obs_dim: int, actions: int, rng: np.random.Generator) -> None:
        self.w = rng.normal(0, 0.01, (obs_dim + 1, actions))
        self.v = np.zeros(obs_dim + 1)
        self.rng = rng

    @staticmethod
    def features(obs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.concatenate(
            [np.asarray(obs, np.float64).reshape(-1, 4), np.ones((len(obs), 1))], 1
        )

    def probs(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        logits = x @ self.w
        e = np.exp(logits - logits.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)  # type: ignore[no-any-return]

    def act(self, obs: Any) -> tuple[int, float, float]:
        x = self.features(np.asarray(obs)[None])
        p = self.probs(x)[0]
        a = int(self.rng.choice(len(p), p=p))
        return a, float(np.log(p[a])), float(x[0] @ self.v)

    def update(self, roll: dict[str, np.ndarray[Any, Any]], epochs: int) -> None:
        x, a, old, adv, ret = (roll[k] for k in ("x", "a", "logp", "adv", "ret"))
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(epochs):
            order = self.rng.permutation(len(a))
            for start in range(0, len(a), BATCH):
                i = order[start : start + BATCH]
                p = self.probs(x[i])
                ratio = np.exp(np.log(p[np.arange(len(i)), a[i]]) - old[i])
                live = np.where(adv[i] >= 0, ratio < 1 + CLIP, ratio > 1 - CLIP)
                coef = np.where(live, ratio * adv[i], 0.0)
                onehot = np.eye(p.shape[1])[a[i]]
                self.w += LR * x[i].T @ (coef[:, None] * (onehot - p)) / len(i)
                self.v += VLR * x[i].T @ (ret[i] - x[i] @ self.v) / len(i)


def rollout(
    env: Any, policy: Policy, n: int, clock: Clock, state: dict[str, Any]
) -> dict[str, Any]:
    """``n`` steps of ``env`` (resetting at each episode's end), with GAE advantages."""
    xs, acts, logps, rews, vals, dones = [], [], [], [], [], []
    obs = state["obs"]
    for _ in range(n):
        a, logp, v = policy.act(obs)
        t = time.perf_counter()
        nxt, r, term, trunc, _ = env.step(a)
        clock.step += time.perf_counter() - t
        clock.steps += 1
        xs.append(policy.features(np.asarray(obs)[None])[0])
        acts.append(a), logps.append(logp), rews.append(r), vals.append(v)
        dones.append(term)
        state["ret"] += r
        if term or trunc:
            clock.returns.append(state["ret"])
            clock.episodes += 1
            state["ret"] = 0.0
            t = time.perf_counter()
            nxt, _ = env.reset()
            clock.reset += time.perf_counter() - t
        obs = nxt
    state["obs"] = obs
    t = time.perf_counter()
    last = float(policy.features(np.asarray(obs)[None])[0] @ policy.v)
    adv, gae = np.zeros(n), 0.0
    for i in reversed(range(n)):
        nv = last if i == n - 1 else vals[i + 1]
        delta = rews[i] + GAMMA * nv * (1 - dones[i]) - vals[i]
        gae = delta + GAMMA * LAM * (1 - dones[i]) * gae
        adv[i] = gae
    roll = {
        "x": np.array(xs),
        "a": np.array(acts),
        "logp": np.array(logps),
        "adv": adv,
        "ret": adv + np.array(vals),
    }
    clock.learn += time.perf_counter() - t
    return roll


def train(env: Any, steps: int, rollout_n: int, epochs: int, seed: int) -> tuple[Clock, float]:
    """PPO for ``steps`` env steps; (the clock, the wall time, reset included)."""
    clock = Clock()
    policy = Policy(4, 2, np.random.default_rng(seed))
    started = time.perf_counter()
    t = time.perf_counter()
    obs, _ = env.reset(seed=seed)
    clock.reset += time.perf_counter() - t
    state = {"obs": obs, "ret": 0.0}
    for _ in range(max(1, steps // rollout_n)):
        roll = rollout(env, policy, rollout_n, clock, state)
        t = time.perf_counter()
        policy.update(roll, epochs)
        clock.learn += time.perf_counter() - t
    return clock, time.perf_counter() - started


def line(name: str, clock: Clock, wall: float) -> str:
    last = clock.returns[-10:] or [0.0]
    return (
        f"{name:<24}{wall:>9.2f}{clock.step:>9.2f}{clock.reset:>9.2f}{clock.learn:>9.2f}"
        f"{clock.steps:>8}{clock.episodes:>6}{clock.steps / wall:>10.0f}{np.mean(last):>9.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--rollout", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--driver", default="qemu")
    ap.add_argument("--lookahead", default="1,3", help="episodes opened ahead, one run each")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    native = gymnasium.make("CartPole-v1")
    n_clock, n_wall = train(native, args.steps, args.rollout, args.epochs, args.seed)
    native.close()
    runs = []
    for ahead in [int(n) for n in args.lookahead.split(",")]:
        ours = gymnasium.make(
            "cleanroom/CartPole-v1", baseline=str(SPEC), driver=args.driver, lookahead=ahead
        )
        try:
            ours.reset(seed=args.seed)  # the baseline, its template, spaces, spares: unmeasured
            runs.append((ahead, *train(ours, args.steps, args.rollout, args.epochs, args.seed)))
        finally:
            ours.close()
    load = os.getloadavg()
    head = f"{'(s)':<24}{'wall':>9}{'step':>9}{'reset':>9}{'learn':>9}{'steps':>8}{'eps':>6}"
    lines = [
        "# bench/gym_train.py: PPO (numpy, linear policy) on CartPole-v1, native and in VMs",
        f"# {time.strftime('%Y-%m-%d %H:%M')} driver={args.driver} steps={args.steps} "
        f"rollout={args.rollout} epochs={args.epochs} load {load[0]:.1f} {args.note}".rstrip(),
        "",
        f"{head}{'steps/s':>10}{'last10':>9}",
        line("native CartPole-v1", n_clock, n_wall),
        *(line(f"cleanroom, lookahead {a}", clock, wall) for a, clock, wall in runs),
        "",
        *(
            f"lookahead {a}: training wall time {wall / n_wall:.1f}x native; stepping alone "
            f"{clock.step / max(n_clock.step, 1e-9):.0f}x; a reset (a fresh VM each) "
            f"{1000 * clock.reset / max(clock.episodes, 1):.1f} ms, a step "
            f"{1000 * clock.step / max(clock.steps, 1):.2f} ms"
            for a, clock, wall in runs
        ),
    ]
    write(OUT, lines)


if __name__ == "__main__":
    main()

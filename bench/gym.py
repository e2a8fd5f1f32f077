"""Gymnasium benchmark: CartPole-v1 stepped inside fresh microVMs vs natively, same run.

Measures on ``examples/gym`` (gymnasium's own CartPole-v1 in the guest), ``--episodes`` episodes
of a balancing policy (up to 500 steps each):
  step round trip, warm        every step after an episode's first ``WARMUP`` (under TCG a fresh
                               clone translates each code path the first time it runs it)
  step round trip, first steps the first ``WARMUP`` steps of each episode
  reference: the same env      gymnasium.make("CartPole-v1") in this process, same actions
  reference: agent PING        the channel's own round trip, in the same VMs
  reset: the whole call        ``env.reset()`` as the caller waits for it: the ends of earlier
                               episodes (settled), the episode opened ahead (its VM up, the env
                               made in it: ``start_s``), GYM_RESET (``reset_s``)
  previous episode's end       export + destroy + confirm absent of the episode a reset left,
                               in the background (overlapping the next episode's steps)
  vector of 4 (AsyncVectorEnv, fork, NEXT_STEP autoreset): steps/s over ``--vector-steps``
  steps, against a native SyncVectorEnv of 4 in the same run.
Results: bench/results/gym.txt.

    python bench/gym.py [--episodes 8] [--vector-steps 300] [--note "..."]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from stats import Table, p50_p95, write

import cleanroom.gym as cgym

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "gym" / "baseline.toml"
OUT = ROOT / "bench" / "results" / "gym.txt"
WARMUP = 20
STEP_TARGET_MS = 3.0
RESET_TARGET_MS = 60.0


def policy(obs: Any) -> int:
    """Push towards where the pole falls (keeps CartPole up for a few hundred steps)."""
    return int(obs[2] + 0.5 * obs[3] > 0)


def vm_episodes(episodes: int) -> dict[str, list[float]]:
    env = cgym.make("CartPole-v1", baseline=str(SPEC), trajectory=True)
    keys = ("warm", "first", "ping", "reset", "start", "gym_reset", "end")
    out: dict[str, list[float]] = {k: [] for k in keys}
    actions: list[list[int]] = []
    try:
        env.reset(seed=0)  # the template, spares, spaces: not measured
        for episode in range(episodes):
            called = time.perf_counter()
            obs, info = env.reset(seed=episode)
            out["reset"].append(time.perf_counter() - called)
            timings = info["cleanroom_timings"]
            out["start"].append(timings["start_s"])
            out["gym_reset"].append(timings["reset_s"])
            taken: list[int] = []
            for t in range(500):
                action = policy(obs)
                taken.append(action)
                started = time.perf_counter()
                obs, _, terminated, truncated, _ = env.step(action)
                out["warm" if t >= WARMUP else "first"].append(time.perf_counter() - started)
                if terminated or truncated:
                    break
            actions.append(taken)
            session = env._episode._sb.episode.env.session  # type: ignore[union-attr]
            out["ping"] += [env._call(session.ping()) for _ in range(50)]
    finally:
        env.close()
    out["end"] = env._run.end_s  # each background end's duration (settled by a reset or close)
    out["native"] = native_steps(actions)
    return out


def native_steps(actions: list[list[int]]) -> list[float]:
    """The same actions, as many steps, natively (its episodes start elsewhere: the in-VM env
    is reset with a seed drawn from the wrapper's ``np_random``; a fall just resets it)."""
    env = gymnasium.make("CartPole-v1")
    times = []
    env.reset(seed=0)
    for action in (a for taken in actions for a in taken):
        started = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        times.append(time.perf_counter() - started)
        if terminated or truncated:
            env.reset()
    env.close()
    return times


def _make(baseline: str) -> cgym.CleanroomEnv:
    return cgym.make("CartPole-v1", baseline=baseline, trajectory=True)


def vector_rate(steps: int) -> tuple[float, float]:
    """Steps per second of a vector of 4 in VMs (async, fork), and natively (sync)."""
    rates = []
    for vec in (
        AsyncVectorEnv(
            [functools.partial(_make, str(SPEC))] * 4,
            context="fork",
            autoreset_mode=AutoresetMode.NEXT_STEP,
        ),
        SyncVectorEnv(
            [lambda: gymnasium.make("CartPole-v1")] * 4, autoreset_mode=AutoresetMode.NEXT_STEP
        ),
    ):
        try:
            obs, _ = vec.reset(seed=1)
            for _ in range(20):  # warm up: every worker's first steps in its first clone
                obs, *_ = vec.step(np.array([policy(o) for o in obs]))
            started = time.perf_counter()
            for _ in range(steps):
                obs, *_ = vec.step(np.array([policy(o) for o in obs]))
            rates.append(steps * 4 / (time.perf_counter() - started))
        finally:
            vec.close()
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--vector-steps", type=int, default=300)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    out = vm_episodes(args.episodes)
    vm_rate, native_rate = vector_rate(args.vector_steps)
    table = Table(("n", "p50", "p95", "max"), 44)
    warm, native, ping = (p50_p95(out[k])[0] for k in ("warm", "native", "ping"))
    reset = p50_p95(out["reset"])[0]
    lines = [
        f"# bench/gym.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.machine()}, "
        f"{os.cpu_count()} cores, load average (1 min) at the start {load:.1f}, "
        f"at the end {os.getloadavg()[0]:.1f}",
        f"# CartPole-v1 (gymnasium {gymnasium.__version__}) in examples/gym VMs, "
        f"{args.episodes} episodes of a balancing policy; warm = after each episode's first "
        f"{WARMUP} steps",
        *([f"# {args.note}"] if args.note else []),
        "",
        table.header("(ms)"),
        table.row("step round trip in the VM, warm", out["warm"]),
        table.row(f"step round trip, first {WARMUP} of an episode", out["first"]),
        table.row("reference: the same env natively", out["native"]),
        table.row("reference: agent PING, same VMs", out["ping"]),
        table.row("reset: the whole reset() call", out["reset"]),
        table.row("  of which: the episode opened ahead", out["start"]),
        table.row("  of which: GYM_RESET round trip", out["gym_reset"]),
        table.row("previous episode's end, in the background", out["end"]),
        "",
        f"step p50: {warm:.2f} ms in the VM = {warm / native:.0f}x native ({native:.3f} ms), "
        f"{warm / ping:.1f}x the same VMs' PING ({ping:.2f} ms); target <= {STEP_TARGET_MS} ms: "
        f"{'met' if warm <= STEP_TARGET_MS else 'NOT met'}",
        f"reset p50 (the whole call: a fresh VM, opened ahead, + env reset): {reset:.1f} ms = "
        f"{reset / ping:.1f}x PING; target <= {RESET_TARGET_MS:.0f} ms: "
        f"{'met' if reset <= RESET_TARGET_MS else 'NOT met'}; the previous episode's end "
        f"({statistics.median(out['end']) * 1000:.0f} ms p50) runs in the background",
        f"vector of 4 (AsyncVectorEnv, fork, NEXT_STEP autoreset, {args.vector_steps} steps): "
        f"{vm_rate:.0f} env steps/s in VMs vs {native_rate:.0f} natively (SyncVectorEnv), "
        f"ratio {vm_rate / native_rate:.4f}",
    ]
    write(OUT, lines)


if __name__ == "__main__":
    main()

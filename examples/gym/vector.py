"""A vector of 4 CartPole-v1 envs, each in its own worker process with its own fresh VMs.

python examples/gym/vector.py          # from the repository root
"""

from __future__ import annotations

import functools

import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode

import cleanroom.gym

make = functools.partial(cleanroom.gym.make, "CartPole-v1", baseline="examples/gym/baseline.toml")

if __name__ == "__main__":  # spawn and forkserver workers import this file
    envs = AsyncVectorEnv(
        [make] * 4, autoreset_mode=AutoresetMode.NEXT_STEP
    )  # loop, VMs: per worker
    try:
        obs, _ = envs.reset(seed=42)
        returns, episodes = np.zeros(4), []
        while len(episodes) < 12:
            actions = (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)
            obs, rewards, terminated, truncated, _ = envs.step(actions)  # a new VM after each end
            returns += rewards
            for i in np.flatnonzero(terminated | truncated):
                episodes.append(returns[i])
                returns[i] = 0
        print(f"{len(episodes)} episodes, mean return {np.mean(episodes):.1f}")
    finally:
        envs.close()

"""Gymnasium's own CartPole-v1 and MountainCar-v0, each episode on a fresh microVM.

python examples/gym/play.py            # from the repository root (builds the baseline once)
"""

from __future__ import annotations

import cleanroom.gym

BASELINE = "examples/gym/baseline.toml"


def balance(obs):  # CartPole: push towards where the pole falls
    return int(obs[2] + 0.5 * obs[3] > 0)


def swing(obs):  # MountainCar: push the way the car already moves
    return 2 if obs[1] >= 0 else 0


for env_id, policy in (("CartPole-v1", balance), ("MountainCar-v0", swing)):
    env = cleanroom.gym.make(env_id, baseline=BASELINE)
    try:
        for seed in range(3):
            obs, info = env.reset(seed=seed)  # the previous episode exported, its VM gone
            total, done = 0.0, False
            while not done:
                obs, reward, terminated, truncated, _ = env.step(policy(obs))
                total, done = total + reward, terminated or truncated
            print(f"{env_id} seed {seed}: return {total:.0f} ({info['episode_id']})")
    finally:
        env.close()  # the last episode exported, every VM confirmed absent
    print(f"run {env.run_id}: cleanroom status {env.run_id} / cleanroom report {env.run_id}")

"""Play CartPole through OpenEnv's own client against `cleanroom serve --openenv`.

    cleanroom serve --template gym=examples/gym/baseline.toml \
        --openenv cartpole=CartPole-v1@gym
    OPENENV_URL=http://user:$KEY@127.0.0.1:3000/openenv/cartpole python examples/openenv/play.py

Each reset is a fresh microVM; each episode leaves a durable record (its run id is printed).
"""

from __future__ import annotations

import os

from openenv.core import GenericEnvClient

url = os.environ.get("OPENENV_URL", "http://127.0.0.1:3000/openenv/cartpole")
with GenericEnvClient(base_url=url).sync() as env:
    for seed in (1, 2):
        result = env.reset(seed=seed)
        total = 0.0
        while not result.done:
            angle = result.observation["obs"][2]  # push the cart under the falling pole
            result = env.step({"action": 1 if angle > 0 else 0})
            total += result.reward or 0.0
        state = env.state()
        print(
            f"seed {seed}: return {total:g} in {state['step_count']} steps, "
            f"record {state['run_id']}/{state['cleanroom_episode_id']}"
        )

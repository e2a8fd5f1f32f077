"""CartPole-v1 in pure Python (standard library only).

A port of Gymnasium's ``gymnasium/envs/classic_control/cartpole.py`` (MIT licence, Farama
Foundation; originally Rich Sutton et al.'s ``pole.c``) plus the ``TimeLimit`` of 500 steps that
``gymnasium.make("CartPole-v1")`` adds. The dynamics are the same: the same constants, the same
equations of motion (see https://coneural.org/florian/papers/05_cart_pole.pdf), the explicit Euler
integrator, float64 state, float32 observations, reward 1.0 for every step including the one
that terminates, termination at |x| > 2.4 or |theta| > 12 degrees, truncation after 500 steps.

What differs: the reset state is drawn uniformly from [-0.05, 0.05) with ``random.Random(seed)``
instead of NumPy's PCG64 generator, so a given seed does NOT give the same initial state (nor
the same episode) as Gymnasium; from the same initial state the trajectories are the same
(checked bit for bit against gymnasium 1.4.0 by tests/examples/test_cartpole_env.py when it is
installed).

It runs on Debian's ``python3-minimal``: no NumPy, only ``math``, ``random`` and ``struct``.
"""

from __future__ import annotations

import math
import random
import struct

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # actually half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds between state updates
THETA_THRESHOLD_RADIANS = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4
MAX_EPISODE_STEPS = 500
RESET_LOW, RESET_HIGH = -0.05, 0.05

State = tuple[float, float, float, float]

_F32 = struct.Struct("<f")


def to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as NumPy's ``astype(np.float32)`` does."""
    try:
        return float(_F32.unpack(_F32.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def step_state(state: State, action: int) -> State:
    """One Euler step of the cart-pole dynamics (pure function of state and action)."""
    x, x_dot, theta, theta_dot = state
    force = FORCE_MAG if action == 1 else -FORCE_MAG
    costheta = math.cos(theta)
    sintheta = math.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sintheta) / TOTAL_MASS
    thetaacc = (GRAVITY * sintheta - costheta * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * costheta**2 / TOTAL_MASS)
    )
    xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
    x = x + TAU * x_dot
    x_dot = x_dot + TAU * xacc
    theta = theta + TAU * theta_dot
    theta_dot = theta_dot + TAU * thetaacc
    return (x, x_dot, theta, theta_dot)


def is_terminal(state: State) -> bool:
    """The pole fell past 12 degrees or the cart left the track."""
    x, _, theta, _ = state
    return bool(
        x < -X_THRESHOLD
        or x > X_THRESHOLD
        or theta < -THETA_THRESHOLD_RADIANS
        or theta > THETA_THRESHOLD_RADIANS
    )


class CartPole:
    """CartPole-v1: ``reset(seed)`` then ``step(action)`` until terminated or truncated.

    Observations are lists of four float32-rounded floats: cart position, cart velocity, pole
    angle (radians), pole angular velocity. Actions: 0 pushes the cart left, 1 pushes it right.
    """

    def __init__(self, max_episode_steps: int = MAX_EPISODE_STEPS) -> None:
        self.max_episode_steps = max_episode_steps
        self.state: State | None = None
        self.elapsed_steps = 0
        self._done = False

    def reset(self, seed: int) -> list[float]:
        rng = random.Random(seed)
        x, x_dot, theta, theta_dot = (rng.uniform(RESET_LOW, RESET_HIGH) for _ in range(4))
        self.state = (x, x_dot, theta, theta_dot)
        self.elapsed_steps = 0
        self._done = False
        return self.observation()

    def observation(self) -> list[float]:
        if self.state is None:
            raise RuntimeError("call reset() before observation()")
        return [to_float32(v) for v in self.state]

    def step(self, action: int) -> tuple[list[float], float, bool, bool]:
        """Advance one step; returns (observation, reward, terminated, truncated)."""
        if self.state is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        if action not in (0, 1):
            raise ValueError(f"action must be 0 or 1, got {action!r}")
        self.state = step_state(self.state, action)
        self.elapsed_steps += 1
        terminated = is_terminal(self.state)
        # Gymnasium's TimeLimit: truncated may be True together with terminated.
        truncated = self.elapsed_steps >= self.max_episode_steps
        self._done = terminated or truncated
        return self.observation(), 1.0, terminated, truncated

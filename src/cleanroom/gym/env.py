"""``CleanroomEnv``: a Gymnasium env whose simulator runs in a fresh microVM per episode.

    env = CleanroomEnv("examples/gym/baseline.toml", env="CartPole-v1")
    obs, info = env.reset(seed=3)          # a fresh VM (a spare clone), the env made in it
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    env.close()                            # the last episode exported, every VM confirmed gone

Nothing boots in ``__init__``. Each ``reset`` starts an episode on a fresh VM: one episode of the
env's run (``run_id``; ``cleanroom status/report`` show it), opened ahead while the one before
stepped (its VM up, the env made in it), so a reset is one GYM_RESET round trip. The episode a
reset leaves behind ends in the background (evidence exported, then its VM destroyed and
confirmed absent); what is guaranteed when: once ``reset`` returns, every episode before the one
it left is durable and its VM confirmed absent; that one's end is complete before the next
``reset`` or ``close`` returns (either raises its failure). ``close`` ends every episode,
the one opened ahead included (``cancelled``: no reset took it). Seeding follows Gymnasium:
``super().reset(seed=seed)`` seeds ``np_random``, which draws the seed the in-VM env is reset
with (the record's ``seed``), so the same seed gives the same trajectory. A ``step`` is one
round trip (arrays as raw bytes, ``gym_codec``). The spaces come from the in-VM env: learned
once per (baseline, env, kwargs) and kept in the home (``spaces.SpaceCache``), so a vector
env's dummy copy or a worker reads them without a VM (the first ever look boots one, recorded
as an episode of policy ``gym-probe``).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import time
import weakref
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from cleanroom.agent import gym_codec
from cleanroom.agent.protocol import Kind
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import GymError
from cleanroom.gym import spaces as space_cache
from cleanroom.gym import wire
from cleanroom.gym.episodes import GymEpisode, GymRun
from cleanroom.gym.loop import LoopThread
from cleanroom.lifecycle.context import RunOptions

SEED_RANGE = 2**31 - 1
MAX_LOOKAHEAD = 8  # episodes opened ahead at most (each a running VM)
RENDER_MODES = ("rgb_array",)  # a VM has no display: frames come back with each answer
_OPEN: weakref.WeakSet[CleanroomEnv] = weakref.WeakSet()  # closed at exit if their owner did not


@atexit.register
def _close_left_open() -> None:
    """A script that raised before ``close`` leaves no VM, run folder or running run."""
    for env in list(_OPEN):
        with contextlib.suppress(Exception):
            env.close()


class CleanroomEnv(gymnasium.Env[Any, Any]):
    """A Gymnasium env (``env``: a Gymnasium id or ``module:Class``, made with ``env_kwargs``)
    run inside fresh VMs of ``baseline`` (a ``Baseline``, a spec path or a digest)."""

    metadata: dict[str, Any] = {"render_modes": list(RENDER_MODES)}

    def __init__(
        self,
        baseline: Baseline | str | Path,
        env: str = "CartPole-v1",
        env_kwargs: dict[str, Any] | None = None,
        *,
        driver: str = "qemu",
        store: str | Path | None = None,
        run_id: str | None = None,
        step_timeout_s: float = 60.0,
        trajectory: bool = True,
        options: RunOptions | None = None,
        lookahead: int = 1,
    ) -> None:
        if not isinstance(env, str) or not env:
            raise GymError(f"CleanroomEnv: env must be a Gymnasium id or module:Class, not {env!r}")
        if not isinstance(lookahead, int) or not 0 <= lookahead <= MAX_LOOKAHEAD:
            raise GymError(f"CleanroomEnv: lookahead must be 0..{MAX_LOOKAHEAD}, not {lookahead!r}")
        if not math.isfinite(step_timeout_s) or step_timeout_s <= 0:
            raise GymError(f"CleanroomEnv: step_timeout_s must be > 0, not {step_timeout_s!r}")
        self.env_id, self.env_kwargs = env, dict(env_kwargs or {})
        self.render_mode = self.env_kwargs.get("render_mode")
        if self.render_mode is not None and self.render_mode not in RENDER_MODES:
            raise GymError(
                f"CleanroomEnv({env}): render_mode {self.render_mode!r} is not supported "
                f"(only {list(RENDER_MODES)}: the env runs in a VM without a display)"
            )
        self._frame: np.ndarray[Any, Any] | None = None
        self.trajectory = trajectory
        self._run = GymRun(
            baseline,
            env,
            self.env_kwargs,
            driver,
            store,
            run_id or "",
            options or RunOptions(parallel=1, spares=1),
            step_timeout_s,
            lookahead=lookahead,
        )
        self._loop: LoopThread | None = None
        self._episode: GymEpisode | None = None
        self._spaces: tuple[gymnasium.Space[Any], gymnasium.Space[Any]] | None = None
        self._closed = False
        self._driven_async = False  # ``areset`` / ``astep`` / ``aclose`` from a host's own loop
        _OPEN.add(self)

    # -- spaces (from the in-VM env) -------------------------------------------------------------

    @property
    def observation_space(self) -> gymnasium.Space[Any]:
        return self._learned_spaces()[0]

    @observation_space.setter
    def observation_space(self, value: gymnasium.Space[Any]) -> None:
        self._spaces = (value, self._learned_spaces()[1])

    @property
    def action_space(self) -> gymnasium.Space[Any]:
        return self._learned_spaces()[1]

    @action_space.setter
    def action_space(self, value: gymnasium.Space[Any]) -> None:
        self._spaces = (self._learned_spaces()[0], value)

    @property
    def run_id(self) -> str:
        """The run every episode of this env belongs to (set at the first reset)."""
        return self._run.run_id

    def _learned_spaces(self) -> tuple[gymnasium.Space[Any], gymnasium.Space[Any]]:
        if self._spaces is None:
            try:
                self._spaces = self._call(self._probe())
            except BaseException:
                self.close()  # nothing of a failed first look stays: no spare, no run open
                raise
        return self._spaces

    async def _probe(self) -> tuple[gymnasium.Space[Any], gymnasium.Space[Any]]:
        await self._run.start()
        assert self._run.baseline is not None
        cache = space_cache.SpaceCache(self._run.baseline.digest, self.env_id, self.env_kwargs)
        known = cache.load()
        if known is not None:
            return known
        episode = await self._run.open_episode("gym-probe")
        episode.begin(0, None, "gym-probe")
        await episode.end()
        return cache.save(episode.made)

    # -- the loop ---------------------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise GymError(f"CleanroomEnv({self.env_id}): closed")
        if self._driven_async:
            coro.close()
            raise GymError(f"CleanroomEnv({self.env_id}): driven by areset/astep, not reset/step")
        if self._loop is None or not self._loop.owned():  # first use, or a fork's copy
            if self._loop is not None:  # the parent's episode is the parent's to end
                self._episode, self._run = None, self._run.fresh_copy()
            self._loop = LoopThread(f"cleanroom-gym-{self.env_id}")
        return self._loop.call(coro)

    # -- the Gymnasium API ------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        inner_seed = int(self.np_random.integers(0, SEED_RANGE))
        return self._call(self._reset(inner_seed, seed, options))  # type: ignore[no-any-return]

    async def _reset(
        self, inner_seed: int, seed: int | None, options: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        started = time.perf_counter()
        await self._run.settle()  # the episodes before the last: durable, their VMs gone
        ended = time.perf_counter()
        if self._episode is not None:
            previous, self._episode = self._episode, None
            self._run.end_later(previous)  # its export, destroy and confirm overlap this reset
        episode = await self._run.take(inner_seed, seed)  # opened ahead: the env made already
        made = time.perf_counter()
        obs_space, act_space, facts = wire.spaces_of(episode.made)
        episode.facts = {**facts, "seed": inner_seed, "reset_seed": seed}
        if self._spaces is None:
            self._spaces = (obs_space, act_space)
        fps = (episode.made.get("metadata") or {}).get("render_fps")
        if isinstance(fps, int | float) and "render_fps" not in self.metadata:
            self.metadata = {**self.metadata, "render_fps": fps}  # the in-VM env's
        header = {"seed": inner_seed, "options": options, **self._render_ask()}
        _, answer = await episode.ask(Kind.GYM_RESET, header)
        self._frame = wire.frame(answer)
        self._episode = episode
        self._run.prepare()  # the next reset's episode, opening while this one steps
        obs, info = wire.reset(answer)
        timings = {  # seconds: waiting for the ends of the episodes before the last one (the
            "end_previous_s": round(ended - started, 6),  # last one's ends in the background);
            "start_s": round(made - ended, 6),  # for this episode's VM with the env made in it
            "reset_s": round(time.perf_counter() - made, 6),  # (opened ahead); its reset
        }
        ids = {"episode_id": episode.episode_id, "run_id": self._run.run_id}
        return obs, {**info, **ids, "cleanroom_timings": timings}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        episode = self._episode
        if episode is None or episode.ended:
            raise GymError(f"CleanroomEnv({self.env_id}): step before reset (or after an error)")
        node, body = gym_codec.encode(action)
        return self._call(self._step(episode, node, body, action))  # type: ignore[no-any-return]

    async def _step(
        self, episode: GymEpisode, node: dict[str, Any], body: bytes, action: Any
    ) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        frame, answer = await episode.ask(Kind.GYM_STEP, {"tree": node, **self._render_ask()}, body)
        obs, reward, terminated, truncated, info = wire.step(frame, answer)
        self._frame = wire.frame(answer)
        episode.steps += 1
        episode.total += reward
        if terminated or truncated:
            episode.facts.update(terminated=terminated, truncated=truncated)
        if self.trajectory:
            episode.record(
                "gym_step",
                t=episode.steps,
                action=_plain(action),
                reward=reward,
                terminated=terminated,
                truncated=truncated,
            )
        return obs, reward, terminated, truncated, info

    def _render_ask(self) -> dict[str, Any]:
        return {"render": True} if self.render_mode == "rgb_array" else {}

    def render(self) -> np.ndarray[Any, Any] | None:
        """The frame of the last reset or step (``render_mode="rgb_array"``: the in-VM env's
        ``render()``, sent with that answer), None before the first reset or without it."""
        return None if self._frame is None else self._frame.copy()

    def close(self) -> None:
        """End the last episode (exported, VM confirmed gone), release the spares. Idempotent."""
        if self._closed:
            return
        loop, self._loop = self._loop, None
        if loop is not None and loop.owned():
            try:
                loop.call(self._aclose())
            finally:
                loop.stop()
        self._closed = True
        _OPEN.discard(self)

    async def _aclose(self) -> None:
        episode, self._episode = self._episode, None
        try:
            if episode is not None:
                await episode.end()
        finally:
            await self._run.aclose()

    # -- the same env for an async host (``cleanroom serve``'s OpenEnv sessions) ------------------

    def _own_loop(self) -> None:
        if self._closed:
            raise GymError(f"CleanroomEnv({self.env_id}): closed")
        if self._loop is not None:
            raise GymError(f"CleanroomEnv({self.env_id}): driven by reset/step, not areset/astep")
        self._driven_async = True

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``reset`` on the caller's running loop, for a host that is async itself: no loop
        thread; every VM is started from that loop's thread (their launchers die with it), so
        the env is used from that one loop only, and closed with ``aclose``."""
        self._own_loop()
        super().reset(seed=seed)
        inner_seed = int(self.np_random.integers(0, SEED_RANGE))
        return await self._reset(inner_seed, seed, options)

    async def astep(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """``step`` on the caller's loop (see ``areset``)."""
        self._own_loop()
        episode = self._episode
        if episode is None or episode.ended:
            raise GymError(f"CleanroomEnv({self.env_id}): step before reset (or after an error)")
        node, body = gym_codec.encode(action)
        return await self._step(episode, node, body, action)

    async def aspaces(self) -> tuple[gymnasium.Space[Any], gymnasium.Space[Any]]:
        """(observation space, action space) on the caller's loop: known after a reset, else
        from the home's cache, else from a probe episode (see the module docstring)."""
        self._own_loop()
        if self._spaces is None:
            self._spaces = await self._probe()
        return self._spaces

    async def aclose(self, reason: str | None = None) -> None:
        """``close`` on the caller's loop (see ``areset``). ``reason``: why the host ended the
        episode in flight (a client gone, a server shutdown): said in its transcript and its
        record's ``info.ended``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        episode = self._episode
        if reason and episode is not None and not episode.ended:
            episode.facts["ended"] = reason
            episode.record("closed", reason=reason)
        await self._aclose()


def _plain(value: Any) -> Any:
    """An action as JSON for the transcript."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value if isinstance(value, int | float | bool | str) or value is None else repr(value)

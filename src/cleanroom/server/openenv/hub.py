"""The served OpenEnv sessions: each one ``CleanroomEnv`` driven on the server's loop.

``OpenEnvHub.open`` makes a session for a key (one creation off the key's creates/s bucket; at
most ``max_sessions`` live, and the key's ``--per-key`` of them, else ``LimitReached``); nothing
boots until its first reset. A session's ``reset`` is an episode on a fresh VM (``areset``), its
``step`` one round trip (``astep``), both one at a time (``lock``). ``end`` closes its env
(``aclose``: the episode in flight ends with ``info.ended`` saying why, its evidence durable,
then its VM destroyed and confirmed absent; the episode opened ahead, if any, ``cancelled``);
``end`` is idempotent, runs shielded from the caller's cancellation and is what a client's
``close``, a disconnect, an idle session, a finished HTTP call and the server's shutdown
(``close``) all come to. Every session's env is its own Gym run (``openenv-NAME-ID``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gymnasium import spaces

from cleanroom.core.baseline_model import Baseline
from cleanroom.gym.env import CleanroomEnv
from cleanroom.lifecycle.context import RunOptions
from cleanroom.server.control import LimitReached, ServerError
from cleanroom.server.keys import Limits, Throttle
from cleanroom.server.openenv import gymjson
from cleanroom.server.openenv.gymjson import RequestInvalid
from cleanroom.server.openenv.spec import OpenEnvSpec

__all__ = ["HubConfig", "OpenEnvHub", "OpenEnvSession", "RequestInvalid"]

Spaces = tuple[spaces.Space[Any], spaces.Space[Any]]


@dataclass
class HubConfig:
    """``cleanroom serve``'s OpenEnv settings."""

    specs: dict[str, OpenEnvSpec]
    driver: str = "qemu"
    max_sessions: int = 16
    lookahead: int = 0  # a WebSocket session's episodes opened ahead (CleanroomEnv's)
    step_timeout_s: float = 60.0
    idle_s: float = 600.0  # a WebSocket session with no message for this long ends
    max_message: int = 1024 * 1024  # bytes of one WebSocket message or HTTP body


@dataclass
class OpenEnvSession:
    """One OpenEnv session (a WebSocket connection, or one stateless HTTP call)."""

    sid: str
    key_id: str
    spec: OpenEnvSpec
    transport: str
    env: CleanroomEnv
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: str | None = None
    episode_id: str | None = None  # the client's (reset's ``episode_id``), else cleanroom's
    cleanroom_episode_id: str | None = None
    step_count: int = 0
    episodes: int = 0
    done: bool = False
    created: float = field(default_factory=time.time)

    def state(self) -> dict[str, Any]:
        """OpenEnv's ``State`` (``episode_id``, ``step_count``) and where the evidence is."""
        return {
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "run_id": self.env.run_id or None,
            "cleanroom_episode_id": self.cleanroom_episode_id,
            "episodes": self.episodes,
            "done": self.done,
            "env": self.spec.name,
        }


def observation(
    obs: Any, info: dict[str, Any], reward: float | None, term: bool, trunc: bool, eid: str
) -> dict[str, Any]:
    """OpenEnv's step-result body (``serialize_observation``): the observation's own fields,
    then ``reward`` and ``done`` beside it."""
    fields = {
        "obs": gymjson.to_json(obs),
        "info": gymjson.to_json(info),
        "terminated": term,
        "truncated": trunc,
        "episode_id": eid,
    }
    return {"observation": fields, "reward": reward, "done": term or trunc}


class OpenEnvHub:
    """The sessions of every served OpenEnv env (see the module docstring)."""

    def __init__(
        self,
        config: HubConfig,
        baseline_of: Callable[[str], Baseline],
        limits: Limits,
        throttle: Throttle,
    ) -> None:
        self.config = config
        self.baseline_of = baseline_of
        self.limits = limits
        self.throttle = throttle
        self.sessions: dict[str, OpenEnvSession] = {}
        self.counts: Counter[str] = Counter()
        self.closing = False
        self._spaces: dict[str, Spaces] = {}
        self._resolving = asyncio.Lock()
        self._probing: dict[str, asyncio.Lock] = {}

    # -- sessions ---------------------------------------------------------------------------------

    async def open(self, key_id: str, spec: OpenEnvSpec, transport: str) -> OpenEnvSession:
        """A new session of ``spec`` for ``key_id`` (nothing boots yet); ``LimitReached``."""
        wait = self.throttle.take(key_id)
        if wait > 0:
            over = f"over {self.limits.creates_per_s:g} creates/s"
            raise self._refused("rate", LimitReached(over, wait))
        async with self._resolving:  # a template is resolved (or built) once
            baseline = await asyncio.to_thread(self.baseline_of, spec.template)
        # from here to the session's registration nothing awaits: the counts stay true
        if self.closing:
            raise self._refused("shutdown", LimitReached("the server is shutting down", 5.0))
        if len(self.sessions) >= self.config.max_sessions:
            over = f"at most {self.config.max_sessions} OpenEnv sessions at once"
            raise self._refused("capacity", LimitReached(over, 1.0))
        mine = sum(1 for s in self.sessions.values() if s.key_id == key_id)
        if mine >= self.limits.max_sandboxes:
            over = f"at most {self.limits.max_sandboxes} OpenEnv sessions per key at once"
            raise self._refused("capacity", LimitReached(over, 1.0))
        sid = secrets.token_hex(8)
        env = CleanroomEnv(
            baseline,
            env=spec.env,
            env_kwargs=spec.kwargs,
            driver=self.config.driver,
            run_id=f"openenv-{spec.name}-{sid}",
            step_timeout_s=self.config.step_timeout_s,
            options=RunOptions(parallel=1, spares=0),
            lookahead=self.config.lookahead if transport == "ws" else 0,
        )
        sess = OpenEnvSession(sid, key_id, spec, transport, env)
        self.sessions[sid] = sess
        self.counts[f"sessions:{transport}"] += 1
        return sess

    def _refused(self, why: str, exc: LimitReached) -> LimitReached:
        self.counts[f"refused:{why}"] += 1
        return exc

    def refused(self, why: str) -> None:
        """Count a request refused before it reached a session (``auth``, ``size``)."""
        self.counts[f"refused:{why}"] += 1

    async def end(self, sess: OpenEnvSession, why: str) -> None:
        """End ``sess`` (see the module docstring); shielded, idempotent."""
        await asyncio.shield(self._end(sess, why))

    async def _end(self, sess: OpenEnvSession, why: str) -> None:
        if sess.ended is not None:
            await sess.closed.wait()
            return
        sess.ended = why
        try:
            async with sess.lock:  # an op in flight finishes first (at most step_timeout_s)
                await sess.env.aclose(reason=why)
        finally:
            self.sessions.pop(sess.sid, None)
            self.counts[f"ended:{why}"] += 1
            sess.closed.set()

    async def close(self) -> None:
        """Server shutdown: every session ends (``shutdown``), each episode's evidence durable
        and its VM confirmed absent, before this returns."""
        self.closing = True
        live = list(self.sessions.values())
        await asyncio.gather(*(self.end(s, "shutdown") for s in live), return_exceptions=True)

    # -- what a session does ----------------------------------------------------------------------

    async def reset(self, sess: OpenEnvSession, data: dict[str, Any]) -> dict[str, Any]:
        """A new episode on a fresh VM; OpenEnv's reset body (``seed``, ``episode_id``, and
        Gymnasium's ``options``) in, its step-result body out."""
        seed, episode_id, options = data.get("seed"), data.get("episode_id"), data.get("options")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise RequestInvalid("seed: expected an integer >= 0")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise RequestInvalid("episode_id: expected a string of at most 255 characters")
        if options is not None and not isinstance(options, dict):
            raise RequestInvalid("options: expected an object")
        async with self._op(sess):
            obs, info = await sess.env.areset(seed=seed, options=options)
            self._spaces.setdefault(sess.spec.name, await sess.env.aspaces())
            eid = str(info.get("episode_id") or "")
            sess.cleanroom_episode_id, sess.episode_id = eid, episode_id or eid
            sess.step_count, sess.done = 0, False
            sess.episodes += 1
            self.counts["episodes"] += 1
            return observation(obs, info, None, False, False, eid)

    async def step(self, sess: OpenEnvSession, action: Any) -> dict[str, Any]:
        """One step of the episode: OpenEnv's action body (``{"action": ..., "metadata": ...}``)
        in, its step-result body out."""
        if not isinstance(action, dict) or "action" not in action:
            raise RequestInvalid('the action is not an object with "action"')
        extra = set(action) - {"action", "metadata"}
        if extra:
            raise RequestInvalid(f"unexpected action fields: {sorted(extra)}")
        async with self._op(sess):
            if sess.cleanroom_episode_id is None:
                raise RequestInvalid("step before reset")
            if sess.done:
                raise RequestInvalid("the episode is done: reset for the next one")
            _, act_space = await sess.env.aspaces()
            value = gymjson.action_of(act_space, action["action"])
            obs, reward, term, trunc, info = await sess.env.astep(value)
            sess.step_count += 1
            sess.done = term or trunc
            self.counts["steps"] += 1
            return observation(obs, info, reward, term, trunc, sess.cleanroom_episode_id)

    @contextlib.asynccontextmanager
    async def _op(self, sess: OpenEnvSession) -> Any:
        async with sess.lock:
            if sess.ended is not None:
                raise ServerError(f"the session has ended ({sess.ended})")
            yield

    async def spaces(self, key_id: str, spec: OpenEnvSpec) -> Spaces:
        """The env's spaces: known once any session reset, else the home's cache, else a probe
        episode (a session of its own, under the same limits)."""
        known = self._spaces.get(spec.name)
        if known is not None:
            return known
        async with self._probing.setdefault(spec.name, asyncio.Lock()):
            if spec.name not in self._spaces:
                sess = await self.open(key_id, spec, "probe")
                try:
                    async with self._op(sess):
                        self._spaces[spec.name] = await sess.env.aspaces()
                finally:
                    await self.end(sess, "probe")
        return self._spaces[spec.name]

    # -- metrics ----------------------------------------------------------------------------------

    def metrics(self) -> list[str]:
        """Prometheus lines for ``/metrics``."""
        c = self.counts
        live = len(self.sessions)

        def labelled(prefix: str, label: str) -> list[str]:
            return [
                f'cleanroom_serve_openenv_{prefix}_total{{{label}="{k.split(":", 1)[1]}"}} {n}'
                for k, n in sorted(c.items())
                if k.startswith(prefix.split("_")[0] + ":")
            ]

        return [
            "# TYPE cleanroom_serve_openenv_sessions_live gauge",
            f"cleanroom_serve_openenv_sessions_live {live}",
            "# TYPE cleanroom_serve_openenv_sessions_total counter",
            *labelled("sessions", "transport"),
            "# TYPE cleanroom_serve_openenv_ended_total counter",
            *labelled("ended", "why"),
            "# TYPE cleanroom_serve_openenv_refused_total counter",
            *labelled("refused", "why"),
            "# TYPE cleanroom_serve_openenv_episodes_total counter",
            f"cleanroom_serve_openenv_episodes_total {c['episodes']}",
            "# TYPE cleanroom_serve_openenv_steps_total counter",
            f"cleanroom_serve_openenv_steps_total {c['steps']}",
        ]

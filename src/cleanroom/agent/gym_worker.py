"""Gymnasium envs in the guest: the gym process the native agent runs (``native/gym.c``).

A baseline that lists its envs in ``/etc/cleanroom/gym.json`` (``{"make": [{"env": id,
"kwargs": {}}], "preimport": [...], "path": [...]}``) gets its gym process at boot: it imports
numpy, gymnasium and ``preimport``, constructs every env of ``make`` and a twin of it (unless
the item says ``"twin": false``), rehearses a reset and a few steps of each (``rehearse``), and
the agent says HELLO only once it is ready, so a snapshot template holds the constructed env
and every clone restores it. GYM_MAKE in a clone rehearses the twin again, so the clone's first
reset and steps of its own env find their code translated (TCG).
Without that file the process starts at the first GYM_MAKE (seconds under TCG).

The agent relays each GYM_* frame (protocol kinds 40-46) to the gym process over a socket pair,
in the control port's own format, and its one answer (GYM_SPACES, GYM_OBS or GYM_ERROR) goes
back to the host. The env's code runs only in the gym process (its own session and process
group): an exception there is a GYM_ERROR, a crash a GYM_ERROR with ``fatal``; the agent lives
on. Values travel as ``gym_codec`` trees (raw array bytes).

GYM_MAKE ``{"env": "CartPole-v1" | "module:Class", "kwargs": {...}}``: the premade env of that
id and kwargs if there is one (``premade`` in the answer), else ``module:Class(**kwargs)`` when
``Class`` is an attribute of ``module``, else ``gymnasium.make(env, **kwargs)``.
"""

from __future__ import annotations

import os
import socket
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if __package__:  # on the host, as part of the package
    from cleanroom.agent import gym_codec
    from cleanroom.agent.protocol import (
        DEFAULT_MAX_BODY,
        Kind,
        dumps,
        encode,
        read_frame,
    )
else:  # in the guest (and in the gym process), next to protocol.py
    import gym_codec  # type: ignore[import-not-found,no-redef]
    from protocol import DEFAULT_MAX_BODY, Kind, dumps, encode, read_frame  # type: ignore[import-not-found,no-redef]

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_FILE = "/etc/cleanroom/gym.json"
READY_S = 60.0
MAX_MESSAGE = 2000  # characters of a traceback sent to the host


# -- the gym process -----------------------------------------------------------------------------


def space_value(space: Any) -> Any:
    """A Gymnasium space as a codec value (arrays stay arrays)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Box):
        return {"kind": "Box", "low": space.low, "high": space.high}
    if isinstance(space, spaces.Discrete):
        return {"kind": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiDiscrete):
        return {"kind": "MultiDiscrete", "nvec": space.nvec, "start": space.start}
    if isinstance(space, spaces.MultiBinary):
        n: Any = space.n
        return {
            "kind": "MultiBinary",
            "n": [int(d) for d in n] if hasattr(n, "__len__") else int(n),
        }
    if isinstance(space, spaces.Dict):
        return {"kind": "Dict", "spaces": {k: space_value(v) for k, v in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"kind": "Tuple", "spaces": tuple(space_value(v) for v in space.spaces)}
    raise TypeError(
        f"{type(space).__name__} spaces are not supported (Box, Discrete, "
        "MultiDiscrete, MultiBinary, Dict, Tuple are)"
    )


def construct(env_id: str, kwargs: dict[str, Any]) -> Any:
    """``module:Class(**kwargs)`` if the module has that attribute, else ``gymnasium.make``."""
    import importlib

    import gymnasium

    module_name, _, attr = env_id.partition(":")
    if attr:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part, None)
        if callable(target):
            return target(**kwargs)
    return gymnasium.make(env_id, **kwargs)


class Server:
    """The gym process's state: the premade envs (each with a twin), and this episode's env."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.premade: dict[str, Any] = {}
        self.twins: dict[str, Any] = {}
        self.env: Any = None
        for item in config.get("make") or []:
            env_id, kwargs = item["env"], item.get("kwargs") or {}
            key = dumps([env_id, kwargs])
            self.premade[key] = rehearse(construct(env_id, kwargs))
            if item.get("twin", True):
                self.twins[key] = rehearse(construct(env_id, kwargs))

    def make(self, header: dict[str, Any]) -> Any:
        import gymnasium
        import numpy

        env_id, kwargs = header["env"], header.get("kwargs") or {}
        key = dumps([env_id, kwargs])
        premade = key in self.premade
        if self.env is not None:
            self.env.close()
        self.env = self.premade.pop(key) if premade else construct(env_id, kwargs)
        twin = self.twins.pop(key, None)
        if twin is not None:  # this VM's first reset and steps, on another instance
            rehearse(twin).close()
        spec = getattr(self.env, "spec", None)
        metadata = getattr(self.env, "metadata", {}) or {}
        return {
            "observation_space": space_value(self.env.observation_space),
            "action_space": space_value(self.env.action_space),
            "metadata": {
                "render_modes": [str(m) for m in metadata.get("render_modes") or []],
                "render_fps": metadata.get("render_fps"),
            },
            "spec_id": getattr(spec, "id", None),
            "premade": premade,
            "versions": {
                "gymnasium": gymnasium.__version__,
                "numpy": numpy.__version__,
                "python": sys.version.split()[0],
            },
        }

    def answer(
        self, kind: int, header: dict[str, Any], body: bytes
    ) -> tuple[int, Any, dict[str, Any]]:
        """(answer kind, value for the body's tree, header fields: a step's reward and flags;
        a NaN reward is sent as it is, and the host refuses it)."""
        if kind == Kind.GYM_MAKE:
            return Kind.GYM_SPACES, self.make(header), {}
        if self.env is None:
            raise RuntimeError("no env: GYM_MAKE comes first")
        if kind == Kind.GYM_RESET:
            obs, info = self.env.reset(seed=header.get("seed"), options=header.get("options"))
            return Kind.GYM_OBS, self.framed(header, obs, info), {}
        if kind == Kind.GYM_STEP:
            action = gym_codec.decode(header.get("tree"), body)
            obs, reward, terminated, truncated, info = self.env.step(action)
            flags = {"r": float(reward), "te": bool(terminated), "tr": bool(truncated)}
            return Kind.GYM_OBS, self.framed(header, obs, info), flags
        if kind == Kind.GYM_CLOSE:
            self.env.close()
            self.env = None
            return Kind.GYM_OBS, None, {}
        raise RuntimeError(f"unexpected frame {kind}")

    def framed(self, header: dict[str, Any], obs: Any, info: Any) -> tuple[Any, ...]:
        """(obs, info), and the env's ``render()`` frame after them when the host asks
        (``"render": true``: an env made with ``render_mode="rgb_array"``), raw bytes in the
        same answer as the observation."""
        if header.get("render"):
            return (obs, info, self.env.render())
        return (obs, info)


def rehearse(env: Any) -> Any:
    """One reset and a few steps of ``env`` and their answers' encoding, discarded (returns
    ``env``). In the template, for every premade env: lazy imports, first-call caches, pages.
    In a clone, on the premade env's *twin* at GYM_MAKE: under TCG a clone translates each code
    path the first time it runs it, so its reset and first steps would pay for that; the twin
    pays instead, and the episode's own env is untouched until its reset."""
    obs, info = env.reset(seed=0)
    gym_codec.encode((obs, info))
    for _ in range(3):
        node, body = gym_codec.encode(env.action_space.sample())
        obs, _, terminated, truncated, info = env.step(gym_codec.decode(node, body))
        gym_codec.encode((obs, info))
        if terminated or truncated:
            break
    return env


def serve(reader: Any, stream: Any, server: Server) -> None:
    """Answer requests until the agent closes the channel."""
    import traceback

    while True:
        try:
            frame = read_frame(reader, max_body=DEFAULT_MAX_BODY)
        except EOFError:
            return
        try:
            kind, value, fields = server.answer(frame.kind, frame.header, frame.body)
            node, body = gym_codec.encode(value)
            if len(body) > DEFAULT_MAX_BODY:
                raise ValueError(f"an answer of {len(body)} bytes exceeds {DEFAULT_MAX_BODY}")
            reply = encode(kind, {"tree": node, **fields}, body)
        except Exception:
            reply = encode(Kind.GYM_ERROR, {"message": traceback.format_exc()[-MAX_MESSAGE:]})
        stream.write(reply)


def main(argv: list[str] | None = None) -> int:
    import json
    import traceback

    argv = sys.argv if argv is None else argv
    sys.path[:] = [p for p in sys.path if p != HERE]  # protocol, gym_codec: imported already
    sock = socket.socket(fileno=int(argv[1]))
    stream, reader = sock.makefile("wb", buffering=0), sock.makefile("rb")  # as ``Proxy``
    started = time.monotonic()
    try:
        config = json.loads(argv[2])
        sys.path[:0] = [p for p in config.get("path") or [] if p not in sys.path]
        for name in ("numpy", "gymnasium", *(config.get("preimport") or [])):
            __import__(name)
        server = Server(config)
    except BaseException:
        stream.write(
            encode(Kind.OK, {"ready": False, "message": traceback.format_exc()[-MAX_MESSAGE:]})
        )
        return 1
    stream.write(
        encode(
            Kind.OK,
            {
                "ready": True,
                "premade": len(server.premade),
                "import_s": round(time.monotonic() - started, 4),
            },
        )
    )
    serve(reader, stream, server)
    return 0

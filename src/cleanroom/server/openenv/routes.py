"""The OpenEnv endpoints under ``/openenv/NAME`` (``openenv-core``'s wire, see ``__init__``).

Auth is the server's API keys, presented as ``X-API-Key``, ``Authorization: Bearer KEY``, or
HTTP Basic with the key as the password: OpenEnv's ``EnvClient`` sets no headers, but the
``websockets`` library it uses sends a URL's user info as Basic auth, so
``http://user:KEY@host:port/openenv/NAME`` is its base URL. ``/health`` is open (OpenEnv's
providers poll it before anything else). Errors are FastAPI's ``{"detail": ...}``, as OpenEnv's
server answers them; over a limit: 429 with ``Retry-After``; a body past ``max_message``: 413.
On the WebSocket, a missing key or unknown env is refused before the handshake completes (401
or 404); then every message gets one answer, errors as ``{"type": "error", "data": {"message",
"code"}}`` with OpenEnv's codes, and the socket closes after ``close``, a capacity refusal,
``idle_s`` without a message, or the server's shutdown.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import math
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from cleanroom.core.version import __version__
from cleanroom.errors import CleanroomError
from cleanroom.server.app import Served
from cleanroom.server.control import LimitReached, ServerError
from cleanroom.server.envd.files import BodyTooLarge, read_body
from cleanroom.server.keys import KeyRing
from cleanroom.server.openenv import gymjson
from cleanroom.server.openenv.hub import HubConfig, OpenEnvHub, OpenEnvSession, RequestInvalid
from cleanroom.server.openenv.spec import OpenEnvSpec

Message = MutableMapping[str, Any]
Handler = Callable[[Request, OpenEnvSpec, str], Awaitable[Response]]


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request presents (see the module docstring), or None."""
    key = headers.get("x-api-key")
    if key:
        return key
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            user, _, password = (
                base64.b64decode(value.strip(), validate=True).decode().partition(":")
            )
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or user or None
    return None


def _detail(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"detail": message}, status, headers=headers)


def _error(exc: CleanroomError) -> Response:
    if isinstance(exc, LimitReached):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return _detail(429, str(exc), {"Retry-After": retry})
    if isinstance(exc, ServerError):
        return _detail(exc.status, str(exc))
    return _detail(500, f"{type(exc).__name__}: {exc}")


def _ws_error(message: str, code: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def openenv_routes(hub: OpenEnvHub, keys: KeyRing) -> list[BaseRoute]:
    """The routes, mounted at ``/openenv``."""
    specs = hub.config.specs

    def keyed(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            spec = specs.get(request.path_params["name"])
            if spec is None:
                return _detail(404, f"no OpenEnv env {request.path_params['name']!r} is served")
            key_id = keys.check(presented_key(request.headers))
            if key_id is None:
                hub.refused("auth")
                return _detail(401, "Missing or invalid API key")
            try:
                return await handler(request, spec, key_id)
            except BodyTooLarge as exc:
                hub.refused("size")
                return _detail(413, str(exc))
            except CleanroomError as exc:
                return _error(exc)

        return endpoint

    async def body(request: Request) -> dict[str, Any]:
        raw = await read_body(request, hub.config.max_message)
        if not raw.strip():
            return {}
        try:
            parsed = json.loads(raw)
        except ValueError as exc:
            raise RequestInvalid(f"the body is not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise RequestInvalid("the body is not a JSON object")
        return parsed

    async def reset(request: Request, spec: OpenEnvSpec, key_id: str) -> Response:
        data = await body(request)
        sess = await hub.open(key_id, spec, "http")
        try:
            return JSONResponse(await hub.reset(sess, data))
        finally:
            await hub.end(sess, "http")

    async def step(request: Request, spec: OpenEnvSpec, key_id: str) -> Response:
        data = await body(request)
        action = data.get("action")
        if not isinstance(action, dict):
            raise RequestInvalid('"action" is required: an object')
        sess = await hub.open(key_id, spec, "http")
        try:  # stateless, as OpenEnv's HTTP step: a fresh env (here a fresh VM), reset, stepped
            await hub.reset(sess, {})
            return JSONResponse(await hub.step(sess, action))
        finally:
            await hub.end(sess, "http")

    async def state(request: Request, spec: OpenEnvSpec, key_id: str) -> Response:
        # stateless too: a fresh env's state (nothing boots for it)
        return JSONResponse({"episode_id": None, "step_count": 0, "episodes": 0, "env": spec.name})

    async def schema(request: Request, spec: OpenEnvSpec, key_id: str) -> Response:
        obs_space, act_space = await hub.spaces(key_id, spec)
        return JSONResponse(gymjson.schemas(obs_space, act_space))

    async def metadata(request: Request, spec: OpenEnvSpec, key_id: str) -> Response:
        kwargs = f" with {json.dumps(spec.kwargs)}" if spec.kwargs else ""
        return JSONResponse(
            {
                "name": spec.name,
                "description": (
                    f"The Gymnasium env {spec.env}{kwargs}, each episode in a fresh cleanroom "
                    f"microVM of the template {spec.template!r}, with a durable record"
                ),
                "readme_content": None,
                "version": __version__,
                "author": None,
                "documentation_url": None,
            }
        )

    async def mcp(request: Request, spec: OpenEnvSpec, key_id: str) -> Response:
        try:
            rid = (await body(request)).get("id")
        except RequestInvalid:
            rid = None
        error = {"code": -32603, "message": "Environment does not support MCP"}
        return JSONResponse({"jsonrpc": "2.0", "error": error, "id": rid})

    async def health(request: Request) -> Response:
        if request.path_params["name"] not in specs:
            return _detail(404, f"no OpenEnv env {request.path_params['name']!r} is served")
        return JSONResponse({"status": "healthy"})

    async def listing(request: Request) -> Response:
        if keys.check(presented_key(request.headers)) is None:
            hub.refused("auth")
            return _detail(401, "Missing or invalid API key")
        envs = [{"name": s.name, "env": s.env, "template": s.template} for s in specs.values()]
        return JSONResponse({"envs": envs})

    async def websocket(ws: WebSocket) -> None:
        spec = specs.get(ws.path_params["name"])
        key_id = keys.check(presented_key(ws.headers))
        if spec is None or key_id is None:
            if key_id is None:
                hub.refused("auth")
            deny = _detail(404, "no such OpenEnv env") if spec is None else None
            await _deny(ws, deny or _detail(401, "Missing or invalid API key"))
            return
        await ws.accept()
        try:
            sess = await hub.open(key_id, spec, "ws")
        except LimitReached as exc:
            active, most = len(hub.sessions), hub.config.max_sessions
            reply = _ws_error(
                str(exc), "CAPACITY_REACHED", active_sessions=active, max_sessions=most
            )
            await _send_and_close(ws, reply, 1013)
            return
        except CleanroomError as exc:
            await _send_and_close(ws, _ws_error(str(exc), "FACTORY_ERROR"), 1011)
            return
        await _session(hub, ws, sess)

    return [
        Mount(
            "/openenv",
            routes=[
                Route("/", listing, methods=["GET"]),
                Route("/{name}/health", health, methods=["GET"]),
                Route("/{name}/metadata", keyed(metadata), methods=["GET"]),
                Route("/{name}/schema", keyed(schema), methods=["GET"]),
                Route("/{name}/state", keyed(state), methods=["GET"]),
                Route("/{name}/reset", keyed(reset), methods=["POST"]),
                Route("/{name}/step", keyed(step), methods=["POST"]),
                Route("/{name}/mcp", keyed(mcp), methods=["POST"]),
                WebSocketRoute("/{name}/ws", websocket),
            ],
        )
    ]


async def _deny(ws: WebSocket, response: Response) -> None:
    """Refuse the handshake with an HTTP response (or, where the server cannot, close 1008)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(response)
    else:
        await ws.close(1008)


async def _send_and_close(ws: WebSocket, text: str, code: int) -> None:
    try:
        await ws.send_text(text)
        await ws.close(code)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass


async def _session(hub: OpenEnvHub, ws: WebSocket, sess: OpenEnvSession) -> None:
    """Answer ``ws``'s messages until it closes, goes idle, or the session ends; then end it."""
    why, close_code, last = "disconnect", 1000, ""
    try:
        while True:
            message = await _next(ws, sess, hub.config.idle_s)
            if message is None:
                if sess.ended is not None:
                    why, close_code = sess.ended, 1001
                    last = _ws_error("the server is shutting down", "SESSION_ERROR")
                else:
                    why, close_code = "idle", 1000
                    idle = hub.config.idle_s
                    last = _ws_error(f"no message for {idle:g}s: session ended", "SESSION_ERROR")
                break
            if message["type"] == "websocket.disconnect":
                break
            raw = message.get("text")
            if raw is None:
                raw = (message.get("bytes") or b"").decode("utf-8", "replace")
            reply = await _answer(hub, sess, raw)
            if reply is None:
                why = "close"
                break
            await ws.send_text(reply)
    except WebSocketDisconnect:
        pass
    finally:
        await hub.end(sess, why)
        if why != "disconnect":
            if last:
                await _send_and_close(ws, last, close_code)
            else:
                await _send_and_close_quietly(ws, close_code)


async def _send_and_close_quietly(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.close(code)


async def _next(ws: WebSocket, sess: OpenEnvSession, idle_s: float) -> Message | None:
    """The next ASGI message of ``ws``; None when the session ended meanwhile or it was idle."""
    receiving = asyncio.ensure_future(ws.receive())
    ending = asyncio.ensure_future(sess.closed.wait())
    try:
        done, _ = await asyncio.wait(
            {receiving, ending}, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        ending.cancel()
        if not receiving.done():
            receiving.cancel()
    if receiving in done:
        return receiving.result()
    return None


async def _answer(hub: OpenEnvHub, sess: OpenEnvSession, raw: str) -> str | None:
    """The reply to one message (None: the client said ``close``)."""
    try:
        message = json.loads(raw)
    except ValueError as exc:
        return _ws_error(f"Invalid JSON: {exc}", "INVALID_JSON")
    if not isinstance(message, dict):
        return _ws_error("Invalid message: not a JSON object", "VALIDATION_ERROR")
    kind, data = message.get("type", ""), message.get("data")
    try:
        if kind == "reset":
            result = await hub.reset(sess, data if isinstance(data, dict) else {})
            return json.dumps({"type": "observation", "data": result})
        if kind == "step":
            if not isinstance(data, dict):
                raise RequestInvalid("a step's data is the action: an object")
            result = await hub.step(sess, data)
            return json.dumps({"type": "observation", "data": result})
        if kind == "state":
            return json.dumps({"type": "state", "data": sess.state()})
        if kind == "close":
            return None
        if kind == "mcp":
            rid = data.get("id") if isinstance(data, dict) else None
            error = {"code": -32603, "message": "Environment does not support MCP"}
            return json.dumps(
                {"type": "mcp", "data": {"jsonrpc": "2.0", "error": error, "id": rid}}
            )
        return _ws_error(f"Unknown message type: {kind}", "UNKNOWN_TYPE")
    except RequestInvalid as exc:
        return _ws_error(f"Invalid message: {exc}", "VALIDATION_ERROR")
    except CleanroomError as exc:
        return _ws_error(f"{type(exc).__name__}: {exc}", "EXECUTION_ERROR")


def attach(served: Served, config: HubConfig) -> OpenEnvHub:
    """The hub of ``config``'s envs, its routes and metrics added to ``served`` (before
    ``build_app``); the caller closes it at shutdown (``OpenEnvHub.close``)."""
    hub = OpenEnvHub(config, served.sandboxes.baseline, served.limits, served.throttle)
    served.more_routes.extend(openenv_routes(hub, served.keys))
    served.more_metrics.append(hub.metrics)
    return hub

"""The ASGI app of ``cleanroom serve``: routes only (the work is in ``control`` and ``envd``).

One port serves both halves of E2B's protocol:

- the control API (``X-API-Key``; no or a wrong key: 401): ``POST /sandboxes``,
  ``GET /sandboxes`` and ``/v2/sandboxes`` (metadata filter, ``limit`` / ``nextToken``),
  ``GET|DELETE /sandboxes/{id}``, ``POST /sandboxes/{id}/timeout`` and ``/refreshes``,
  ``POST /sandboxes/{id}/connect`` and ``/v2/sandboxes/{id}/connect`` (a paused sandbox is
  resumed: 201), ``/resume``, ``POST .../pause`` (204; 409 if paused already), ``POST
  .../fork`` (``count`` new sandboxes: 201 and one ``{"sandbox"}`` or ``{"error"}`` each),
  ``GET .../logs`` (the session's transcript as log entries); named snapshots: ``POST
  .../snapshots`` (201 ``{"snapshotID", "names"}``), ``GET /snapshots`` (the key's;
  ``sandboxID``, ``name``, ``limit`` / ``nextToken``), ``DELETE /templates/{snapshot id}``
  (204; 404 unknown or another key's), and ``POST /sandboxes`` with the snapshot's id (or
  name) as ``templateID``;
- envd, routed by ``E2b-Sandbox-Id`` (or the ``{port}-{id}.{domain}`` host name):
  ``/process.Process/*`` and ``/filesystem.Filesystem/*`` (Connect RPC, by ``connectrpc``
  with the SDK's own generated apps and messages), ``GET|POST /files``, ``GET /health``;
- a guest port (``sandbox.get_host(port)``: Host ``{port}-{id}.{domain}``, or
  ``E2b-Sandbox-Id`` with ``E2b-Sandbox-Port``): HTTP and WebSocket proxied over the agent
  channel (``ports``), with the sandbox's traffic access token or its key;
- ``GET /metrics``: Prometheus text (sandboxes live, created, ended by why, named snapshots
  held, refused by why, port bytes and requests);
- what ``Served.more_routes`` adds (``/openenv/...``: ``server.openenv``), its lines in
  ``/metrics`` from ``Served.more_metrics``.

Errors are E2B's JSON (``{"code", "message"}``); 429s carry ``Retry-After``; bodies past
``max_body`` are 413.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from cleanroom.errors import CleanroomError
from cleanroom.server.control import (
    Conflict,
    LimitReached,
    Sandbox,
    Sandboxes,
    ServerError,
    iso,
)
from cleanroom.server.envd.files import BodyTooLarge, get_file, post_file, read_body
from cleanroom.server.envd.filesystem import FilesystemService
from cleanroom.server.envd.process import ProcessService
from cleanroom.server.envd.routing import sandbox_of
from cleanroom.server.keys import KeyRing, Limits, Throttle
from cleanroom.server.ports import PortCounts, PortProxy, target_of
from cleanroom.server.usage import Usage
from cleanroom.sessions import AsyncSession

CONTROL_BODY_MAX = 1024 * 1024


@dataclass
class Served:
    """What the routes share: the sandboxes, the keys, the limits, the counters."""

    sandboxes: Sandboxes
    keys: KeyRing
    limits: Limits = field(default_factory=Limits)
    max_body: int = 256 * 1024 * 1024
    counts: Counter[str] = field(default_factory=Counter)
    ports: PortCounts = field(default_factory=PortCounts)
    more_routes: list[BaseRoute] = field(default_factory=list)  # other protocols' (OpenEnv)
    more_metrics: list[Callable[[], list[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.throttle = Throttle(self.limits)


def _err(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"code": status, "message": message}, status, headers=headers)


def _server_error(exc: CleanroomError) -> Response:
    if isinstance(exc, LimitReached):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return _err(429, str(exc), {"Retry-After": retry})
    if isinstance(exc, ServerError):
        return _err(exc.status, str(exc))
    return _err(500, f"{type(exc).__name__}: {exc}")


ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def build_app(served: Served) -> ASGIApp:
    """The server's ASGI app: guest-port requests (``ports.target_of``) to the port proxy,
    everything else to the control and envd routes."""
    routes = _routes(served)
    proxy = PortProxy(served.sandboxes, served.keys, served.max_body, served.ports)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            target = target_of(headers)
            if target is not None:
                await proxy(scope, receive, send, target)
                return
        await routes(scope, receive, send)

    return app


def _routes(served: Served) -> Starlette:
    sandboxes = served.sandboxes

    def key_of(request: Request) -> str | None:
        return served.keys.check(request.headers.get("x-api-key"))

    async def body_json(request: Request) -> dict[str, Any]:
        raw = await read_body(request, CONTROL_BODY_MAX)
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ServerError(f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ServerError("the body is not a JSON object")
        return body

    def control(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            key_id = key_of(request)
            if key_id is None:
                return _err(
                    401,
                    "Invalid API key" if request.headers.get("x-api-key") else "Missing API key",
                )
            try:
                return await handler(request, key_id)  # type: ignore[no-any-return]
            except CleanroomError as exc:
                if isinstance(exc, BodyTooLarge | LimitReached):
                    served.counts[f"refused:{exc.status}"] += 1
                return _server_error(exc)

        return endpoint

    async def create(request: Request, key_id: str) -> Response:
        body = await body_json(request)
        wait = served.throttle.take(key_id)
        if wait > 0:
            raise LimitReached(f"over {served.limits.creates_per_s:g} creates/s", wait)
        template = str(body.get("templateID") or "base")
        network: list[str] | None = None
        if body.get("allow_internet_access") is False:
            network = []
        net = body.get("network")
        if isinstance(net, dict) and isinstance(net.get("allowOut"), list):
            network = [str(h) for h in net["allowOut"]]
        sbx = await sandboxes.create(
            key_id,
            template,
            timeout_s=_number(body.get("timeout")),
            metadata=_strings(body.get("metadata")),
            envs=_strings(body.get("envVars")),
            network=network,
            max_per_key=served.limits.max_sandboxes,
        )
        served.counts["created"] += 1
        return JSONResponse(sandboxes.created(sbx), 201)

    async def listing(request: Request, key_id: str) -> Response:
        wanted = dict(urllib.parse.parse_qsl(request.query_params.get("metadata", "")))
        states = set(request.query_params.get("state", "running,paused").split(","))
        found = [
            s
            for s in sandboxes.of_key(key_id, paused=True)
            if s.state in states and all(s.metadata.get(k) == v for k, v in wanted.items())
        ]
        found.sort(key=lambda s: (s.started_at, s.sandbox_id))
        limit = int(request.query_params.get("limit") or 100)
        start = request.query_params.get("nextToken")
        if start:
            found = [s for s in found if s.sandbox_id > start] if start else found
        page, rest = found[:limit], found[limit:]
        headers = {"x-next-token": page[-1].sandbox_id} if rest and page else {}
        return JSONResponse([sandboxes.listed(s) for s in page], headers=headers)

    async def info(request: Request, key_id: str) -> Response:
        sbx = sandboxes.get_any(key_id, request.path_params["sid"])
        return JSONResponse(sandboxes.detail(sbx))

    async def kill(request: Request, key_id: str) -> Response:
        await sandboxes.kill(key_id, request.path_params["sid"])
        served.counts["killed"] += 1
        return Response(status_code=204)

    async def set_timeout(request: Request, key_id: str) -> Response:
        body = await body_json(request)
        seconds = _number(body.get("timeout"))
        if seconds is None:
            raise ServerError("timeout is required")
        sandboxes.set_timeout(key_id, request.path_params["sid"], seconds)
        return Response(status_code=204)

    async def refresh(request: Request, key_id: str) -> Response:
        body = await body_json(request)
        sbx = sandboxes.get(key_id, request.path_params["sid"])
        sandboxes.set_timeout(key_id, sbx.sandbox_id, _number(body.get("duration")) or 60)
        return Response(status_code=204)

    async def connect(request: Request, key_id: str) -> Response:
        body = await body_json(request)
        sid = request.path_params["sid"]
        if body.get("memory") is False:
            raise ServerError("a resume from disk alone (memory: false) is not served here")
        paused = sandboxes.get_paused(key_id, sid) is not None
        if not paused and request.url.path.endswith("/resume"):
            raise Conflict(f"sandbox {sid} is not paused")
        seconds = _number(body.get("timeout"))
        if paused and seconds is not None:
            sandboxes.get_any(key_id, sid).timeout_s = seconds
        sbx = await sandboxes.resume(key_id, sid)
        if seconds is not None and not paused:
            sandboxes.set_timeout(key_id, sbx.sandbox_id, seconds)
        return JSONResponse(sandboxes.created(sbx), 201 if paused else 200)

    async def pause(request: Request, key_id: str) -> Response:
        await body_json(request)  # memory / requireHealthyGuest: the snapshot holds both
        if not await sandboxes.pause(key_id, request.path_params["sid"]):
            return _err(409, "the sandbox is already paused")
        served.counts["paused"] += 1
        return Response(status_code=204)

    async def fork(request: Request, key_id: str) -> Response:
        body = await body_json(request)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int):
            raise ServerError("count must be a whole number")
        children = await sandboxes.fork(
            key_id,
            request.path_params["sid"],
            count,
            _number(body.get("timeout")),
            served.limits.max_sandboxes,
        )
        served.counts["forked"] += len(children)
        return JSONResponse([{"sandbox": sandboxes.created(c)} for c in children], 201)

    async def snapshot(request: Request, key_id: str) -> Response:
        body = await body_json(request)
        if body.get("memory") is False:
            raise ServerError("a snapshot of the disk alone (memory: false) is not served here")
        name = body.get("name")
        snap = await sandboxes.create_snapshot(
            key_id,
            request.path_params["sid"],
            str(name) if name else None,
            served.limits.max_sandboxes,
        )
        served.counts["snapshots"] += 1
        return JSONResponse({"snapshotID": snap.snapshot_id, "names": snap.names}, 201)

    async def snapshots(request: Request, key_id: str) -> Response:
        q = request.query_params
        found = sandboxes.snapshots_of(key_id, q.get("sandboxID") or None)
        if q.get("name"):
            found = [s for s in found if q["name"] in (s.snapshot_id, s.name)]
        start = q.get("nextToken")
        if start:
            found = [s for s in found if s.snapshot_id > start]
        found.sort(key=lambda s: s.snapshot_id)
        limit = int(q.get("limit") or 100)
        page, rest = found[:limit], found[limit:]
        headers = {"x-next-token": page[-1].snapshot_id} if rest and page else {}
        body = [{"snapshotID": s.snapshot_id, "names": s.names} for s in page]
        return JSONResponse(body, headers=headers)

    async def delete_snapshot(request: Request, key_id: str) -> Response:
        await sandboxes.delete_snapshot(key_id, request.path_params["tid"])
        return Response(status_code=204)

    async def logs(request: Request, key_id: str) -> Response:
        sbx = sandboxes.get(key_id, request.path_params["sid"])
        limit = min(int(request.query_params.get("limit") or 1000), 10_000)
        entries = await asyncio.to_thread(transcript_entries, sbx, limit)
        if request.url.path.startswith("/v2/"):
            return JSONResponse({"logs": entries})
        lines = [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries]
        return JSONResponse({"logs": lines, "logEntries": entries})

    usage = Usage(sandboxes.config.driver)

    async def sandbox_metrics(request: Request, key_id: str) -> Response:
        sbx = sandboxes.get(key_id, request.path_params["sid"])
        start, end = _seconds(request, "start"), _seconds(request, "end")
        usage.forget(set(sandboxes.by_id))
        sb = sbx.sb
        if isinstance(sb, AsyncSession) and sbx.live:  # held here (not on a Ray node)
            try:
                env_id = sb.live_env().env_id
            except CleanroomError:  # it ended meanwhile: what was kept
                env_id = None
            if env_id is not None:
                limits = sb.episode.limits
                await asyncio.to_thread(
                    usage.sample, sbx.sandbox_id, env_id, limits.vcpus, limits.memory_mib
                )
        return JSONResponse(usage.samples(sbx.sandbox_id, start, end))

    def envd_sandbox(request: Request) -> Sandbox:
        return sandbox_of(sandboxes, request.headers.get)

    async def files(request: Request) -> Response:
        try:
            sbx = envd_sandbox(request)
            if request.method == "GET":
                return await get_file(sbx, request)
            return await post_file(sbx, request, served.max_body)
        except CleanroomError as exc:
            return _server_error(exc)

    async def health(request: Request) -> Response:
        if request.headers.get("e2b-sandbox-id"):
            try:
                envd_sandbox(request)
            except CleanroomError:
                return _err(502, "The sandbox was not found")
        return Response(status_code=204)

    async def metrics(request: Request) -> Response:
        live = sum(1 for s in sandboxes.by_id.values() if s.live)
        lines = [
            "# TYPE cleanroom_serve_sandboxes_live gauge",
            f"cleanroom_serve_sandboxes_live {live}",
            "# TYPE cleanroom_serve_sandboxes_created_total counter",
            f"cleanroom_serve_sandboxes_created_total {served.counts['created']}",
            "# TYPE cleanroom_serve_sandboxes_ended_total counter",
            *(
                f'cleanroom_serve_sandboxes_ended_total{{why="{why}"}} {n}'
                for why, n in sorted(sandboxes.ended.items())
            ),
            "# TYPE cleanroom_serve_snapshots gauge",
            f"cleanroom_serve_snapshots {len(sandboxes.snapshots)}",
            "# TYPE cleanroom_serve_requests_refused_total counter",
            *(
                f'cleanroom_serve_requests_refused_total{{status="{k[8:]}"}} {n}'
                for k, n in sorted(served.counts.items())
                if k.startswith("refused:")
            ),
            *served.ports.lines(),
            *(line for lines in served.more_metrics for line in lines()),
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    filesystem = FilesystemService(sandboxes)
    served.more_metrics.append(filesystem.watchers.lines)
    sid = "/sandboxes/{sid}"
    routes = [
        Route("/sandboxes", control(create), methods=["POST"]),
        Route("/v2/sandboxes", control(create), methods=["POST"]),
        Route("/sandboxes", control(listing), methods=["GET"]),
        Route("/v2/sandboxes", control(listing), methods=["GET"]),
        Route(sid, control(info), methods=["GET"]),
        Route(sid, control(kill), methods=["DELETE"]),
        Route(sid + "/timeout", control(set_timeout), methods=["POST"]),
        Route(sid + "/refreshes", control(refresh), methods=["POST"]),
        Route(sid + "/connect", control(connect), methods=["POST"]),
        Route("/v2" + sid + "/connect", control(connect), methods=["POST"]),
        Route(sid + "/resume", control(connect), methods=["POST"]),
        Route(sid + "/pause", control(pause), methods=["POST"]),
        Route(sid + "/fork", control(fork), methods=["POST"]),
        Route(sid + "/snapshots", control(snapshot), methods=["POST"]),
        Route("/snapshots", control(snapshots), methods=["GET"]),
        Route("/templates/{tid}", control(delete_snapshot), methods=["DELETE"]),
        Route(sid + "/logs", control(logs), methods=["GET"]),
        Route("/v2" + sid + "/logs", control(logs), methods=["GET"]),
        Route(sid + "/metrics", control(sandbox_metrics), methods=["GET"]),
        Route("/files", files, methods=["GET", "POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Mount(
            "/process.Process",
            ProcessASGIApplication(ProcessService(sandboxes), read_max_bytes=served.max_body),
        ),
        Mount(
            "/filesystem.Filesystem",
            FilesystemASGIApplication(filesystem, read_max_bytes=CONTROL_BODY_MAX),
        ),
        *served.more_routes,
    ]
    return Starlette(routes=routes)


def transcript_entries(sbx: Sandbox, limit: int) -> list[dict[str, Any]]:
    """The last ``limit`` steps of the sandbox's transcript (redacted as it is kept) as E2B
    log entries: the step as the message, its fields as the entry's fields."""
    if sbx.sb is None:
        return []
    try:
        raw = sbx.sb.transcript.path.read_bytes().splitlines()[-limit:]
    except OSError:
        return []
    out = []
    for line in raw:
        try:
            step = json.loads(line)
        except ValueError:
            continue
        when = step.pop("at", 0.0)
        fields = {str(k): json.dumps(v) if not isinstance(v, str) else v for k, v in step.items()}
        out.append(
            {
                "timestamp": iso(float(when)),
                "level": "info",
                "message": line.decode(errors="replace"),
                "fields": fields,
            }
        )
    return out


def _seconds(request: Request, name: str) -> int | None:
    """A query parameter in Unix seconds (``start``, ``end``), if given."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ServerError(f"{name} must be Unix seconds, not {raw[:40]!r}") from None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _strings(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items()}

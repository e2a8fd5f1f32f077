"""envd's plain HTTP ``/files``: read (``GET``) and write (``POST``, multipart or octet-stream).

``GET /files?path=P[&username=U]``: the file's bytes (``gzip`` when the client accepts it);
404 for a missing file. ``POST /files?path=P``: ``application/octet-stream`` (optionally
``Content-Encoding: gzip``) writes one file; ``multipart/form-data`` writes each ``file`` part
to its filename (or ``path`` for a single part). Both through the session's ``files`` (a
transcript step each); bodies are bounded (413 past ``max_body``, also after gunzip).
"""

from __future__ import annotations

import gzip
import posixpath
import zlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cleanroom.errors import CleanroomError, GuestFileNotFound, SessionClosed
from cleanroom.server.control import Sandbox, ServerError


class BodyTooLarge(ServerError):
    status = 413


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes before more is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise BodyTooLarge(f"the body is over {limit} bytes")
    return bytes(body)


def gunzip(data: bytes, limit: int) -> bytes:
    """``data`` gunzipped, refused past ``limit`` bytes (a gzip bomb stops there)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise ServerError(f"the body is not gzip: {exc}") from exc
    if len(out) > limit or d.unconsumed_tail:
        raise BodyTooLarge(f"the body unpacks to over {limit} bytes")
    return out


def _compressible(data: bytes) -> bool:
    """Whether gzip is worth its CPU: an 8 KiB probe (0.1 ms; 64 KiB cost 1.5 ms of a 1 MiB
    read) shrinks by more than a tenth (random or packed bytes go out as they are, which
    ``Accept-Encoding`` always allows)."""
    if len(data) < 1024:
        return False
    probe = data[:8192]
    return len(zlib.compress(probe, 1)) < 0.9 * len(probe)


def _error(exc: Exception) -> Response:
    if isinstance(exc, GuestFileNotFound | SessionClosed):
        return JSONResponse({"code": 404, "message": str(exc)}, 404)
    if isinstance(exc, ServerError):
        return JSONResponse({"code": exc.status, "message": str(exc)}, exc.status)
    return JSONResponse({"code": 400, "message": f"{type(exc).__name__}: {exc}"}, 400)


async def get_file(sbx: Sandbox, request: Request) -> Response:
    path = request.query_params.get("path", "")
    if not path:
        return _error(ServerError("path is required"))
    assert sbx.sb is not None
    try:
        data = await sbx.sb.files.read(path)
    except CleanroomError as exc:
        return _error(exc)
    headers = {"Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"'}
    if "gzip" in request.headers.get("accept-encoding", "") and _compressible(data):
        return Response(
            gzip.compress(data, 5),
            media_type="application/octet-stream",
            headers={**headers, "Content-Encoding": "gzip"},
        )
    return Response(data, media_type="application/octet-stream", headers=headers)


async def post_file(sbx: Sandbox, request: Request, limit: int) -> Response:
    assert sbx.sb is not None
    path = request.query_params.get("path", "")
    kind = request.headers.get("content-type", "")
    try:
        if kind.startswith("multipart/form-data"):
            files = await _parts(request, path, limit)
        else:
            body = await read_body(request, limit)
            if request.headers.get("content-encoding", "").lower() == "gzip":
                body = gunzip(body, limit)
            if not path:
                raise ServerError("path is required")
            files = [(path, body)]
        written = []
        for name, data in files:
            await sbx.sb.files.write(name, data)
            written.append({"name": posixpath.basename(name), "type": "file", "path": name})
    except (CleanroomError, ValueError) as exc:
        return _error(exc)
    return JSONResponse(written)


async def _parts(request: Request, path: str, limit: int) -> list[tuple[str, bytes]]:
    """The ``file`` parts of a multipart body, parsed in memory (bounded by ``limit``: no
    spool files), each with its filename (or ``path`` for a single part)."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    body = await read_body(request, limit)
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise ServerError("a multipart body without a boundary")
    parts: list[tuple[dict[bytes, bytes], bytes]] = []
    cur: dict[str, Any] = {}

    def begin() -> None:
        cur.update(headers={}, data=bytearray(), field=b"", value=b"")

    def field(data: bytes, start: int, end: int) -> None:
        cur["field"] += data[start:end]

    def value(data: bytes, start: int, end: int) -> None:
        cur["value"] += data[start:end]

    def header_end() -> None:
        cur["headers"][cur["field"].lower()] = cur["value"]
        cur["field"], cur["value"] = b"", b""

    def data(chunk: bytes, start: int, end: int) -> None:
        cur["data"] += chunk[start:end]

    def end() -> None:
        parts.append((cur["headers"], bytes(cur["data"])))

    callbacks = {
        "on_part_begin": begin,
        "on_header_field": field,
        "on_header_value": value,
        "on_header_end": header_end,
        "on_part_data": data,
        "on_part_end": end,
    }
    parser = MultipartParser(boundary, callbacks, max_size=limit)  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except Exception as exc:  # python-multipart's errors: the client's malformed body
        raise ServerError(f"a malformed multipart body: {exc}") from exc
    files = []
    for headers, payload in parts:
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        if disposition.get(b"name") == b"file":
            files.append((disposition.get(b"filename", b"").decode(errors="replace"), payload))
    out = []
    for filename, payload in files:
        name = path if (len(files) == 1 and path) else (filename or path)
        if not name:
            raise ServerError("a file part without a path")
        out.append((name, payload))
    return out

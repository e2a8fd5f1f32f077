"""The agent wire protocol: length-prefixed frames of (type, JSON header, optional bytes).

Standard library only: this file is copied into every baseline's root filesystem next to the
guest agent, and imported by the host. Layout of one frame (big-endian)::

    magic  2 bytes  b"CR"
    type   1 byte   a ``Kind``
    hlen   4 bytes  length of the JSON header (UTF-8 object)
    blen   4 bytes  length of the body (raw bytes, may be 0)
    header hlen bytes
    body   blen bytes

The reader checks the magic, the type, both lengths against its limits, and that the header is
a JSON object, before it allocates anything; a peer that sends anything else gets
``BadFrame`` (the host maps it onto ``cleanroom.errors.ProtocolError``).
"""

from __future__ import annotations

import struct

try:  # json's C half, used directly: importing json itself compiles regular expressions (re,
    import _json  # enum), ~0.4 s of a guest's boot under TCG, which the codec does not need
except ImportError:  # pragma: no cover - not CPython
    _json = None  # type: ignore[assignment]

# Neither ``typing`` nor ``enum`` at run time: each import costs the guest ~0.1-0.2 s under TCG.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, BinaryIO

PROTOCOL_VERSION = 1
MAGIC = b"CR"
PREFIX = struct.Struct(">2sBII")
HEARTBEAT_S = 1.0

# The limits of what one side may send the other: the one set (docs/manifests.md). The host
# enforces each at its boundary (``cleanroom.agent.wire``, ``session``); the guest keeps to them.
MAX_HEADER = 256 * 1024  # bytes of one frame's JSON header
DEFAULT_MAX_BODY = 1024 * 1024  # bytes of one frame's body (a driver may negotiate another)
CHUNK = 256 * 1024  # bytes per FILE, RESULT or DATA frame: any transfer is sent in chunks
RESULT_MAX_BYTES = 4 * 1024 * 1024  # bytes of /run/cleanroom/result.json
MAX_JSON_DEPTH = 64  # nesting of any JSON document the guest sends (header or result)
MAX_JSON_ITEMS = 1_000_000  # values (keys, items, scalars) in one such document
MAX_JSON_INT = 2**63 - 1  # magnitude of an integer in it (floats must be finite)
MAX_NAME = 1024  # UTF-8 bytes of an artifact name (a relative path)
MAX_NAME_PART = 255  # UTF-8 bytes of one of its components (NAME_MAX)
MAX_NAME_PARTS = 32  # components of one artifact name
MAX_ARTIFACTS = 10_000  # artifacts of one episode
MAX_MESSAGE = 1000  # characters of a guest's error message kept by the host


class Kind:
    """Frame types (plain ints). Direction in brackets: h = host, g = guest."""

    HELLO = 1  # [g->h] agent is ready: {agent_version, protocol, boot_time, ...}
    RUN = 2  # [h->g] run the episode: {manifest, entrypoint, env, timeout_s, secrets}
    EXEC = 3  # [h->g] run a command: {id, argv, env, cwd, timeout_s, user, stdin, pty}
    # 4, 5: retired (the first protocol's unnumbered PUT and GET; now UPLOAD and DOWNLOAD)
    STDOUT = 6  # [g->h] body = bytes the process wrote to stdout
    STDERR = 7  # [g->h] body = bytes the process wrote to stderr
    FILE = 8  # [g->h] {name, offset, eof, kind}: one chunk of an episode's artifact
    RESULT = 9  # [g->h] {present, offset, eof}: one chunk of raw result.json (any bytes)
    EXIT = 10  # [g->h] {code, signal, duration_s, timed_out}
    ERROR = 11  # [both] {message}
    PING = 12  # [h->g] heartbeat request
    PONG = 13  # [g->h] heartbeat answer
    SHUTDOWN = 14  # [h->g] power off now
    DONE = 15  # [g->h] everything of the current request was sent
    OK = 16  # [g->h] SNAPSHOT_PREPARE or WARM_UP done (and the gym worker: ready)
    HEARTBEAT = 17  # [g->h] still alive, sent every HEARTBEAT_S while a request runs
    SNAPSHOT_PREPARE = 18  # [h->g] a snapshot follows: on EOF wait for the next host (OK)
    RESEED = 19  # [h->g] a restored clone: {clone_id, time_ns}, body = host entropy (HELLO)
    # Multiplexed requests (HELLO ``features`` has "mux"): every frame of one carries its ``id``
    # (the host's number for it), several run at once; EXEC, DONE, EXIT, STDOUT, STDERR do too.
    STDIN = 20  # [h->g] {id, eof}, body = bytes for the process's stdin (ACK once written)
    KILL = 21  # [h->g] {id}: SIGKILL the request's process group, or stop its transfer
    RESIZE = 22  # [h->g] {id, rows, cols}: the window size of a PTY process
    STARTED = 23  # [g->h] {id, pid}: an EXEC's process runs
    FAILED = 24  # [g->h] {id, code, message}: that request failed; the guest itself is fine
    UPLOAD = 25  # [h->g] {id, path, mode, tar}: DATA frames follow; answered by DONE {id, size}
    DOWNLOAD = 26  # [h->g] {id, path, tar}: answered by DATA frames, then DONE {id, size}
    DATA = 27  # [both] {id, offset, eof}, body = one chunk (at most CHUNK) of a stream
    ACK = 28  # [both] {id, size}: the receiver consumed ``size`` bytes of the stream so far
    WARM_UP = 29  # [h->g] a spare: the warm worker walks an episode's paths once; OK {warmed}
    # A VM's bulk disk (HELLO ``features`` has "bulk"; ``bulk.py``): a file's bytes on a disk
    BULK_PUT = 30  # [h->g] {id, path, mode, offset, size}: the disk's first bytes into the file
    BULK_GET = 31  # [h->g] {id, path, offset, max}: the file's bytes onto it; DONE {size, eof}
    FS = 32  # [h->g] {id, op, path, dest, depth}: stat/list/mkdir/rename/remove; DONE (``fs.py``)
    # A guest TCP port (HELLO ``features`` has "port"; ``ports.py``): STARTED, DATA/ACK both ways
    CONNECT = 33  # [h->g] {id, port}: 127.0.0.1:port in the guest; DONE {size, received}
    # 40-49: Gymnasium envs in the guest (``gym_worker.py``; values: ``gym_codec.py``)
    GYM_MAKE = 40  # [h->g] {env, kwargs}: construct the env (or take the premade one); SPACES
    GYM_SPACES = 41  # [g->h] {tree}, body: the env's spaces, metadata and versions
    GYM_RESET = 42  # [h->g] {seed, options}: answered by GYM_OBS
    GYM_STEP = 43  # [h->g] {tree}, body: the action; answered by GYM_OBS
    GYM_OBS = 44  # [g->h] {tree}, body: what reset/step/close returned
    GYM_CLOSE = 45  # [h->g] close the env: answered by GYM_OBS (None)
    GYM_ERROR = 46  # [g->h] {message}: the env (not the agent) failed this request


NAMES = {v: k for k, v in vars(Kind).items() if isinstance(v, int)}
FEATURES = ("mux", "stdin", "spawn", "pty", "user", "stream", "tar", "gym", "bulk", "fs", "port")
WINDOW = 16 * CHUNK  # bytes of a stream sent and not yet acknowledged (ACK), either way
EXTENSION_KINDS = range(20, 50)  # 20-39 this protocol, 40-49 other modules (``register_kind``)


def register_kind(name: str, value: int) -> int:
    """Let another module add a frame kind (a number in ``EXTENSION_KINDS`` nobody has)."""
    if value not in EXTENSION_KINDS or NAMES.get(value, name) != name:
        raise ValueError(f"frame kind {value} ({name}) is taken or out of range")
    NAMES[value] = name
    return value


def kind_name(kind: int) -> str:
    return NAMES.get(kind, f"type {kind}")


class Frame:
    """One decoded frame."""

    __slots__ = ("body", "header", "kind")

    def __init__(self, kind: int, header: dict[str, Any], body: bytes = b"") -> None:
        self.kind = kind
        self.header = header
        self.body = body

    def __repr__(self) -> str:
        return f"Frame({kind_name(self.kind)}, {self.header!r}, {len(self.body)} bytes)"


class BadFrame(Exception):
    """The byte stream is not a valid frame (wrong magic, type, size or header)."""


class TooLarge(BadFrame):
    """A frame whose declared size exceeds the reader's limit."""


def dumps(value: Any, separators: tuple[str, str] = (",", ":")) -> str:
    """``json.dumps(value, separators=separators)``, without importing json."""
    if _json is None:  # pragma: no cover - not CPython
        import json

        return json.dumps(value, separators=separators)
    item_separator, key_separator = separators
    encoder = _json.make_encoder(
        {}, _unserializable, _json.encode_basestring_ascii, None,
        key_separator, item_separator, False, False, True,
    )  # fmt: skip
    return "".join(encoder(value, 0))


def loads(text: str) -> Any:
    """``json.loads(text)``: the C scanner for a compact document (what ``dumps`` writes);
    anything else (whitespace around it, malformed input) is left to json itself."""
    if _json is not None:
        try:
            value, end = _json.make_scanner(_ScanContext)(text, 0)  # type: ignore[arg-type]
            if end == len(text):
                return value
        except Exception:  # json.loads below decides, and names the error
            pass
    import json

    return json.loads(text)


class _ScanContext:
    """What ``_json.make_scanner`` reads: json.loads' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {
        "-Infinity": float("-inf"),
        "Infinity": float("inf"),
        "NaN": float("nan"),
    }.__getitem__


def _unserializable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def encode(kind: int, header: dict[str, Any] | None = None, body: bytes = b"") -> bytes:
    """Serialize one frame."""
    raw_header = dumps(header or {}).encode("utf-8")
    if len(raw_header) > MAX_HEADER:  # the peer would refuse it and close the channel
        raise TooLarge(f"header of {len(raw_header)} bytes exceeds {MAX_HEADER}; not sent")
    return PREFIX.pack(MAGIC, int(kind), len(raw_header), len(body)) + raw_header + body


def parse_prefix(prefix: bytes, max_body: int) -> tuple[int, int, int]:
    """Validate a frame prefix; return (kind, header length, body length)."""
    magic, kind, hlen, blen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise BadFrame(f"bad magic {magic!r}")
    if kind not in NAMES:
        raise BadFrame(f"unknown frame type {kind}")
    if hlen > MAX_HEADER:
        raise TooLarge(f"header of {hlen} bytes exceeds {MAX_HEADER}")
    if blen > max_body:
        raise TooLarge(f"body of {blen} bytes exceeds {max_body}")
    return kind, hlen, blen


def parse_header(raw: bytes) -> dict[str, Any]:
    """Decode a frame header; it must be a JSON object."""
    try:
        header = loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadFrame(f"header is not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise BadFrame("header is not a JSON object")
    return header


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    parts: list[bytes] = []
    remaining = size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            raise EOFError("channel closed mid-frame" if parts or size != remaining else "closed")
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def read_frame(stream: BinaryIO, max_body: int = DEFAULT_MAX_BODY) -> Frame:
    """Blocking read of one frame (used by the guest). Raises EOFError on a closed stream."""
    kind, hlen, blen = parse_prefix(_read_exact(stream, PREFIX.size), max_body)
    header = parse_header(_read_exact(stream, hlen))
    body = _read_exact(stream, blen) if blen else b""
    return Frame(kind, header, body)

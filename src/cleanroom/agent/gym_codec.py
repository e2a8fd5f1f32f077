"""The binary codec of Gymnasium values between host and guest: a JSON tree plus raw bytes.

Standard library here; numpy is imported only by ``encode``/``decode`` (the guest's gym
process and the host have it, the agent itself never calls them). Copied into every baseline
next to ``gym_worker.py``; the host uses the same ``decode`` as its boundary for what the
guest sends (``cleanroom.gym.wire`` maps ``BadTree`` onto ``ProtocolError``).

A value becomes ``(node, body)``: the node (a frame's JSON header) says what the body's bytes
are, in order, with no offsets (so nothing overlaps and every byte is accounted for):

    array / numpy scalar   {"t": dtype, "s": [dims]}          body: the C-order bytes
                           (+ "k": "n" a numpy scalar, "i"/"f"/"b" a Python int/float/bool)
    dict (str keys)        {"d": [[key, node], ...]}          (order kept)
    tuple / list           {"u": [node, ...]}  / {"l": [...]}
    str / None             {"x": "text"}  /  {"z": 0}

``decode`` refuses (``BadTree``) any dtype outside ``DTYPES`` (no objects, no structured or
big-endian types), more than ``MAX_NDIM`` dimensions, a dimension over ``MAX_DIM``, more than
``MAX_NODES`` nodes, nesting deeper than ``MAX_DEPTH``, text over ``MAX_TEXT`` characters, and
a body whose length is not exactly what the node describes.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)
MAX_NDIM = 8
MAX_DIM = 1 << 24
MAX_NODES = 4096
MAX_DEPTH = 16
MAX_TEXT = 4096
PY_SCALARS = {"i": int, "f": float, "b": bool}
PY_DTYPES = {"i": "int64", "f": "float64", "b": "bool"}  # how encode sends a Python scalar
INT64 = range(-(1 << 63), 1 << 63)


class BadTree(ValueError):
    """A node/body pair that is not a value this codec makes (guest input: never trusted)."""


def encode(value: Any) -> tuple[dict[str, Any], bytes]:
    """``value`` (arrays, numpy or Python scalars, str, None, dicts, tuples, lists) as a node
    and its body. Anything else is sent as its ``repr`` text (an info dict's odd values)."""
    parts: list[bytes] = []
    node = _encode(value, parts, 0)
    return node, b"".join(parts)


def _encode(value: Any, parts: list[bytes], depth: int) -> dict[str, Any]:
    np = _numpy()
    if isinstance(value, np.ndarray | np.generic):  # first: the common case (an observation)
        array = np.asarray(value)  # tobytes() is C order (ascontiguousarray: ndim >= 1)
        if array.dtype.name not in DTYPES:
            return {"x": repr(value)[:MAX_TEXT]}
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        parts.append(array.tobytes())
        node: dict[str, Any] = {"t": array.dtype.name, "s": list(array.shape)}
        if isinstance(value, np.generic):
            node["k"] = "n"
        return node
    if depth > MAX_DEPTH:
        return {"x": "<too deep>"}
    if value is None:
        return {"z": 0}
    if isinstance(value, str):
        return {"x": value[:MAX_TEXT]}
    if isinstance(value, bool | int | float):  # without numpy: a step's action, most often
        if isinstance(value, bool):
            parts.append(b"\x01" if value else b"\x00")
            return {"t": "bool", "s": [], "k": "b"}
        if isinstance(value, int):
            if value not in INT64:
                return {"x": repr(value)[:MAX_TEXT]}
            parts.append(int(value).to_bytes(8, "little", signed=True))
            return {"t": "int64", "s": [], "k": "i"}
        parts.append(struct.pack("<d", value))
        return {"t": "float64", "s": [], "k": "f"}
    if isinstance(value, dict):
        return {"d": [[str(k), _encode(v, parts, depth + 1)] for k, v in value.items()]}
    if isinstance(value, tuple | list):
        items = [_encode(v, parts, depth + 1) for v in value]
        return {"u": items} if isinstance(value, tuple) else {"l": items}
    return {"x": repr(value)[:MAX_TEXT]}


_NUMPY: Any = None


def _numpy() -> Any:
    """numpy, imported on first use (the agent, which only forwards frames, never does)."""
    global _NUMPY
    if _NUMPY is None:
        import numpy

        _NUMPY = numpy
    return _NUMPY


def decode(node: Any, body: bytes) -> Any:
    """The value ``encode`` made, from a node and body that came from anywhere: every array is
    a fresh, writable copy; ``BadTree`` for anything ``encode`` would not have made."""
    reader = _Reader(body)
    value = reader.node(node, 0)
    if reader.offset != len(body):
        raise BadTree(f"{len(body) - reader.offset} bytes of body left over")
    return value


class _Reader:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.offset = 0
        self.nodes = 0

    def node(self, node: Any, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise BadTree(f"more than {MAX_NODES} nodes")
        if depth > MAX_DEPTH:
            raise BadTree(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(node, dict) or len(node) == 0:
            raise BadTree("a node is not a non-empty object")
        if "t" in node:
            return self.array(node)
        if len(node) != 1:
            raise BadTree(f"a node with keys {sorted(node)[:4]}")
        ((tag, inner),) = node.items()
        if tag == "z":
            return None
        if tag == "x":
            if not isinstance(inner, str) or len(inner) > MAX_TEXT:
                raise BadTree("text that is not a string of at most MAX_TEXT characters")
            return inner
        if tag in ("u", "l"):
            if not isinstance(inner, list):
                raise BadTree(f"{tag!r} is not a list")
            items = [self.node(item, depth + 1) for item in inner]
            return tuple(items) if tag == "u" else items
        if tag == "d":
            if not isinstance(inner, list):
                raise BadTree("'d' is not a list")
            out: dict[str, Any] = {}
            for pair in inner:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise BadTree("a dict entry is not [key, node]")
                if len(pair[0]) > MAX_TEXT or pair[0] in out:
                    raise BadTree("a dict key too long or repeated")
                out[pair[0]] = self.node(pair[1], depth + 1)
            return out
        raise BadTree(f"unknown node tag {tag[:20]!r}")

    def py_scalar(self, kind: str) -> Any:
        """A Python int/float/bool as ``encode`` sends it, read without numpy (the same value
        the array path gives: int64 and float64 little-endian, a bool any non-zero byte)."""
        size = 1 if kind == "b" else 8
        if size > len(self.body) - self.offset:
            raise BadTree(f"an array of {size} bytes past the body's end")
        raw = bytes(self.body[self.offset : self.offset + size])
        self.offset += size
        if kind == "b":
            return raw != b"\x00"
        if kind == "i":
            return int.from_bytes(raw, "little", signed=True)
        return struct.unpack("<d", raw)[0]

    def array(self, node: dict[str, Any]) -> Any:
        np = _numpy()

        dtype, shape, kind = node.get("t"), node.get("s"), node.get("k")
        if set(node) - {"t", "s", "k"}:
            raise BadTree("an array node with unknown keys")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise BadTree(f"dtype {str(dtype)[:20]!r} is not allowed")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise BadTree(f"a shape that is not a list of at most {MAX_NDIM} dimensions")
        if shape == [] and isinstance(kind, str) and PY_DTYPES.get(kind) == dtype:
            return self.py_scalar(kind)
        count = 1
        for dim in shape:
            if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim <= MAX_DIM:
                raise BadTree("a dimension that is not an int in [0, MAX_DIM]")
            count *= dim
        size = count * np.dtype(dtype).itemsize
        if size > len(self.body) - self.offset:
            raise BadTree(f"an array of {size} bytes past the body's end")
        raw = np.frombuffer(
            self.body, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=self.offset
        ).reshape(shape)
        # a copy in native order; a bool is any non-zero byte (not a bool of byte 2)
        array = np.asarray(raw.view(np.uint8) != 0) if dtype == "bool" else raw.astype(dtype)
        self.offset += size
        if kind is None:
            return array
        if shape != []:
            raise BadTree("a scalar node with a shape")
        if kind == "n":
            return array[()]
        if kind in PY_SCALARS:
            return PY_SCALARS[kind](array[()])
        raise BadTree(f"unknown scalar kind {str(kind)[:20]!r}")

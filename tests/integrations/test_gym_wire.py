"""The Gymnasium codec and the host's boundary for what the in-VM env sends (issue 19): values
survive the trip exactly, and any node/body pair the guest makes up decodes to a value or a
typed error (``BadTree`` in the codec, ``ProtocolError`` at the host), never anything else."""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis not installed (make setup)")
gymnasium = pytest.importorskip("gymnasium", reason="gymnasium not installed (cleanroom[gym])")

from gymnasium import spaces  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from cleanroom.agent import gym_codec, gym_worker  # noqa: E402
from cleanroom.agent.protocol import Frame, Kind  # noqa: E402
from cleanroom.errors import GymEnvError, ProtocolError  # noqa: E402
from cleanroom.gym import wire  # noqa: E402

DTYPES = sorted(gym_codec.DTYPES)


def _arrays() -> st.SearchStrategy[np.ndarray]:
    return st.sampled_from(DTYPES).flatmap(
        lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4))
    )


def _values() -> st.SearchStrategy[object]:
    leaves = (
        _arrays()
        | st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**63 - 1)
        | st.floats(allow_nan=False)
        | st.text(max_size=20)
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.tuples(inner, inner)
            | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=12,
    )


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, True)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))  # type: ignore[arg-type]
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a)))


@settings(max_examples=300, deadline=None)
@given(_values())
def test_every_value_survives_the_codec_exactly(value: object) -> None:
    """Arrays keep dtype, shape and bytes (as fresh writable copies); Python and numpy scalars
    keep their types; tuples stay tuples; dict order stays."""
    node, body = gym_codec.encode(value)
    json.dumps(node)  # the node is a frame header: plain JSON
    decoded = gym_codec.decode(node, body)
    assert _same(value, decoded)
    for leaf in _leaves(decoded):
        assert leaf.flags.writeable


def _leaves(value: object) -> list[np.ndarray]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _leaves(v)]
    return []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=20,
)
_nodes = st.recursive(
    st.fixed_dictionaries(
        {
            "t": st.sampled_from([*DTYPES, "object", "<f4", "V8"]) | _json,
            "s": st.lists(st.integers(-2, 9), max_size=9) | _json,
        }
    )
    | st.dictionaries(st.sampled_from(["z", "x", "k", "t", "q"]), _json, max_size=2),
    lambda inner: (
        st.fixed_dictionaries(
            {"d": st.lists(st.tuples(st.text(max_size=3), inner).map(list), max_size=3)}
        )
        | st.fixed_dictionaries({"u": st.lists(inner, max_size=3)})
        | st.fixed_dictionaries({"l": st.lists(inner, max_size=3)})
    ),
    max_leaves=10,
)


@settings(max_examples=500, deadline=None)
@given(_nodes | _json, st.binary(max_size=64))
def test_made_up_trees_decode_or_are_refused(node: object, body: bytes) -> None:
    """Whatever the guest claims about its bytes: a value, or BadTree; at the host, a value or
    ProtocolError (the spaces and step checks included)."""
    with contextlib.suppress(gym_codec.BadTree):
        gym_codec.decode(node, body)
    frame = Frame(Kind.GYM_OBS, {"tree": node, "r": 1.0, "te": False, "tr": False}, body)
    with contextlib.suppress(ProtocolError):
        wire.step(frame, wire.value(frame, Kind.GYM_OBS))
    with contextlib.suppress(ProtocolError):
        spaces_frame = Frame(Kind.GYM_SPACES, {"tree": node}, body)
        wire.spaces_of(wire.value(spaces_frame, Kind.GYM_SPACES))


@pytest.mark.parametrize(
    ("node", "body", "why"),
    [
        ({"t": "object", "s": []}, b"\0" * 8, "dtype"),
        ({"t": "float32", "s": [4]}, b"\0" * 15, "past the body"),
        ({"t": "float32", "s": [1]}, b"\0" * 5, "left over"),
        ({"t": "uint8", "s": [1] * 9}, b"\0", "dimensions"),
        ({"t": "uint8", "s": [2**30]}, b"", "dimension"),
        ({"t": "int64", "s": [1], "k": "n"}, b"\0" * 8, "scalar"),
        ({"u": [{"z": 0}] * (gym_codec.MAX_NODES + 1)}, b"", "nodes"),
    ],
)
def test_the_codec_refuses_by_name(node: object, body: bytes, why: str) -> None:
    """Each limit is enforced (and named): dtype allowlist, exact body, dimensions, nodes."""
    with pytest.raises(gym_codec.BadTree, match=why):
        gym_codec.decode(node, body)


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    node: object = {"z": 0}
    for _ in range(5000):
        node = {"u": [node]}
    with pytest.raises(gym_codec.BadTree, match="deeper"):
        gym_codec.decode(node, b"")


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(gym_codec.PY_DTYPES.items())), st.binary(max_size=10))
def test_python_scalars_read_without_numpy_as_numpy_reads_them(
    pair: tuple[str, str], body: bytes
) -> None:
    """The numpy-free path for a Python int/float/bool (``_Reader.py_scalar``, a step's action)
    gives what the array path gives for any bytes the guest sends, or the same refusal."""
    kind, dtype = pair
    node = {"t": dtype, "s": [], "k": kind}
    size = np.dtype(dtype).itemsize
    if len(body) != size:
        with pytest.raises(gym_codec.BadTree):
            gym_codec.decode(node, body)
        return
    raw = np.frombuffer(body, np.dtype(dtype).newbyteorder("<"))
    want = gym_codec.PY_SCALARS[kind]((raw.view(np.uint8) != 0)[0] if kind == "b" else raw[0])
    got = gym_codec.decode(node, body)
    assert type(got) is type(want) and _same(got, want)
    assert gym_codec.encode(got) == (node, body) or kind != "i"  # ints: canonical bytes


def test_bools_are_canonical() -> None:
    """A bool array made of byte 2 is True, not a bool numpy would misbehave on."""
    assert gym_codec.decode({"t": "bool", "s": [2]}, b"\x02\x00").tolist() == [True, False]


SPACES = [
    spaces.Box(-1.0, 1.0, (3, 2), np.float32),
    spaces.Box(0, 255, (4, 4, 3), np.uint8),
    spaces.Discrete(5, start=-2),
    spaces.MultiDiscrete([3, 4, 5]),
    spaces.MultiBinary([2, 3]),
    spaces.MultiBinary(4),
    spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "k": spaces.Discrete(3)}),
    spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 1, (1,)))),
]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_spaces_cross_as_themselves(space: spaces.Space[object]) -> None:
    """What the gym process says about a space, the host rebuilds equal."""
    made = {"observation_space": gym_worker.space_value(space),
            "action_space": gym_worker.space_value(spaces.Discrete(2))}  # fmt: skip
    node, body = gym_codec.encode(made)
    observation, action, _ = wire.spaces_of(
        wire.value(Frame(Kind.GYM_SPACES, {"tree": node}, body), Kind.GYM_SPACES)
    )
    assert observation == space
    assert action == spaces.Discrete(2)


@pytest.mark.parametrize(
    ("desc", "why"),
    [
        ({"kind": "Box", "low": np.zeros(2), "high": np.zeros(3)}, "differ"),
        ({"kind": "Discrete", "n": 0, "start": 0}, "Discrete.n"),
        ({"kind": "Discrete", "n": True, "start": 0}, "Discrete.n"),
        ({"kind": "MultiDiscrete", "nvec": np.array([0]), "start": np.array([0])}, "nvec"),
        ({"kind": "MultiBinary", "n": [2**22, 2]}, "too many"),
        ({"kind": "Box", "low": np.zeros(2**22 + 1, np.uint8), "high": 0}, "more than"),
        ({"kind": "Graph"}, "not supported"),
        ({"kind": "Tuple", "spaces": [1]}, "not a tuple"),
    ],
)
def test_bad_spaces_are_protocol_errors(desc: object, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        wire.space(desc)


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ({"r": "1", "te": False, "tr": False}, "reward"),
        ({"r": 1.0, "te": 0, "tr": False}, "bools"),
        ({"te": False, "tr": False}, "reward"),
    ],
)
def test_a_step_answer_is_checked(header: dict[str, object], why: str) -> None:
    node, body = gym_codec.encode((np.zeros(2), {}))
    frame = Frame(Kind.GYM_OBS, {"tree": node, **header}, body)
    with pytest.raises(ProtocolError, match=why):
        wire.step(frame, wire.value(frame, Kind.GYM_OBS))


def test_a_guest_error_is_a_gym_env_error_with_its_message() -> None:
    frame = Frame(Kind.GYM_ERROR, {"message": "Traceback ... AssertionError: bad action"})
    with pytest.raises(GymEnvError, match="bad action"):
        wire.value(frame, Kind.GYM_OBS)

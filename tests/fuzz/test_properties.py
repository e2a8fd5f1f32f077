"""Property tests (hypothesis) of the host's boundary for guest bytes and of the redactor: any
JSON decodes to itself or a ProtocolError, any name is refused or creatable inside its folder,
a secret in any JSON spelling is redacted. Protects issue 15 §1/§4/§10."""

from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis not installed (make setup)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cleanroom.agent import wire  # noqa: E402
from cleanroom.errors import ProtocolError  # noqa: E402
from cleanroom.evidence.secrets import Redactor  # noqa: E402

from . import targets  # noqa: E402


def _json_values() -> st.SearchStrategy[object]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=30,
    )


@settings(max_examples=300, deadline=None)
@given(_json_values())
def test_any_json_decodes_to_itself_or_a_protocol_error(value: object) -> None:
    raw = json.dumps(value).encode()  # NaN and huge ints included: they must be refused
    try:
        decoded = wire.decode_json(raw, wire.RESULT, "doc")
    except ProtocolError:
        return
    assert json.dumps(decoded) == json.dumps(value)
    json.dumps(decoded, allow_nan=False).encode("utf-8")  # a record can hold it


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_any_name_is_refused_or_creatable_inside_its_folder(name: str) -> None:
    targets.check("name", name.encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=4, max_size=24).filter(lambda s: s.strip() == s and "\x00" not in s),
    st.booleans(),
    st.text(max_size=20),
)
def test_a_secret_in_any_json_spelling_is_redacted(secret: str, ascii: bool, around: str) -> None:
    """Any serialization of a document holding the secret (escaped or not), decoded after
    redaction, holds no secret; and the count is what was replaced."""
    redactor = Redactor({"S": secret})
    raw = json.dumps({around + secret: [secret, around]}, ensure_ascii=ascii).encode()
    redacted = redactor.redact_json(wire.decode_json(raw, wire.RESULT, "doc"))
    ((key, values),) = redacted.items()  # the decoded strings (a serialization may spell
    assert all(secret not in text for text in (key, *values))  # another char as "\\u0000")
    assert redactor.counts["S"] >= 2

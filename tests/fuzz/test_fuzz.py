"""The fuzz targets in ``make test``: the committed corpus and crash reproducers replayed, a brief
coverage-guided run of every target (atheris; ``make fuzz`` runs 1,000,000 inputs each), and
property tests (hypothesis). Protects issue 15 §1/§10: no guest-facing parser raises anything
but its typed errors (on the old code a deep header raised RecursionError, a lone surrogate
name UnicodeEncodeError at os.open, a NaN in metrics failed at export)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cleanroom.agent import protocol, wire
from cleanroom.errors import ProtocolError
from cleanroom.secrets import Redactor

from . import targets

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
CRASHES = HERE / "crashes"
BRIEF_S = int(os.environ.get("CLEANROOM_FUZZ_BRIEF_S", "8"))  # per target; 6 targets < 2 min


def _inputs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("path", _inputs(CORPUS), ids=lambda p: f"{p.parent.name}/{p.name}"[:60])
def test_corpus_replays_with_typed_errors_only(path: Path) -> None:
    targets.check(path.parent.name, path.read_bytes())


@pytest.mark.parametrize("path", _inputs(CRASHES), ids=lambda p: p.name)
def test_crash_reproducers_are_fixed(path: Path) -> None:
    """A committed reproducer of a target with a ``KNOWN`` untyped error (issue 15 §9, owned by
    the operator-input item) is an expected failure until that lands; then it must pass."""
    target = path.name.split("-")[0]
    if target in targets.KNOWN:
        try:
            targets.check(target, path.read_bytes())
        except targets.KNOWN[target] as exc:
            pytest.xfail(f"known, issue 15 §9: {type(exc).__name__}")
    else:
        targets.check(target, path.read_bytes())


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_brief_coverage_guided_run(target: str, tmp_path: Path) -> None:
    """libFuzzer exits non-zero (and writes the input) on the first untyped exception."""
    work = tmp_path / "corpus"
    work.mkdir()
    command = [
        sys.executable,
        str(HERE / "fuzz.py"),
        target,
        f"-max_total_time={BRIEF_S}",
        "-rss_limit_mb=2048",
        "-max_len=65536",
        f"-artifact_prefix={tmp_path}/",
        str(work),
        str(CORPUS / target),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BRIEF_S + 60)
    crashes = [p.name for p in tmp_path.iterdir() if p.name != "corpus"]
    assert done.returncode == 0 and not crashes, done.stderr[-3000:]


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
    assert secret not in json.dumps(redacted, ensure_ascii=False)
    assert redactor.counts["S"] >= 2


def test_limits_are_consistent() -> None:
    """Chunks fit in a frame, and a whole result fits in the chunks the agent sends."""
    assert protocol.CHUNK <= protocol.DEFAULT_MAX_BODY
    assert protocol.MAX_NAME_PART * protocol.MAX_NAME_PARTS >= protocol.MAX_NAME
    assert protocol.MAX_HEADER < protocol.RESULT_MAX_BYTES

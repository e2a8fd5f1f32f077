"""Manifest files are validated whole, before anything runs; problems name line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cleanroom.errors import ManifestError
from cleanroom.manifest import (
    Limits,
    Manifest,
    NetworkRequest,
    load_manifests,
    parse_manifests,
)

GOOD = {"episode_id": "ep-1", "seed": 3, "policy": {"id": "angle", "params": {"k": 0.5}}}


def _lines(*items: object) -> str:
    return "\n".join(i if isinstance(i, str) else json.dumps(i) for i in items)


def test_good_file_parses() -> None:
    manifests = parse_manifests(_lines(GOOD, {**GOOD, "episode_id": "ep-2"}, "", "# comment"))
    assert [m.episode_id for m in manifests] == ["ep-1", "ep-2"]
    assert manifests[0].policy.params == {"k": 0.5}


def test_every_bad_line_is_reported_with_line_and_field() -> None:
    text = _lines(
        GOOD,
        "{not json",
        {**GOOD, "episode_id": "ep-3", "seed": -1},
        {**GOOD, "episode_id": "../etc"},
        {**GOOD, "episode_id": "ep-5", "limits": {"timeout_s": 0}},
        {**GOOD, "episode_id": "ep-6", "surprise": 1},
        {**GOOD},  # duplicate of line 1
        [1, 2],
    )
    with pytest.raises(ManifestError) as info:
        parse_manifests(text, source="m.jsonl")
    problems = info.value.problems
    assert any(p.startswith("line 2: not valid JSON") for p in problems)
    assert any(p.startswith("line 3: seed:") for p in problems)
    assert any(p.startswith("line 4: episode_id:") for p in problems)
    assert any(p.startswith("line 5: limits.timeout_s:") for p in problems)
    assert any(p.startswith("line 6: surprise:") for p in problems)
    assert any(p.startswith("line 7: episode_id:") and "line 1" in p for p in problems)
    assert any(p.startswith("line 8: must be a JSON object") for p in problems)
    assert "nothing was run" in str(info.value)


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ManifestError, match="no manifests"):
        load_manifests(path)


def test_unreadable_file_is_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifests(tmp_path / "absent.jsonl")


def test_baseline_must_be_a_full_digest() -> None:
    with pytest.raises(ManifestError, match="baseline"):
        parse_manifests(_lines({**GOOD, "baseline": "sha256:abc"}))


def test_limits_fall_back_to_baseline_then_builtin() -> None:
    merged = Limits(timeout_s=5).merged_over(Limits(timeout_s=60, memory_mib=512))
    assert (merged.timeout_s, merged.memory_mib, merged.vcpus) == (5, 512, 1)


def test_digest_is_stable_and_content_sensitive() -> None:
    a = Manifest.model_validate(GOOD)
    b = Manifest.model_validate(json.loads(json.dumps(GOOD)))
    c = Manifest.model_validate({**GOOD, "seed": 4})
    assert a.digest() == b.digest() != c.digest()


def test_network_allow_entries_are_validated_per_line() -> None:
    ok = {**GOOD, "network": {"allow": ["api.example.com:443", "10.0.0.0/8:5432"]}}
    [manifest] = parse_manifests(_lines(ok))
    assert manifest.network is not None
    assert manifest.network.allow == ["api.example.com:443", "10.0.0.0/8:5432"]
    bad = _lines(
        {**GOOD, "network": {"allow": ["api.example.com"]}},
        {**GOOD, "episode_id": "ep-2", "network": {"deny": []}},
    )
    with pytest.raises(ManifestError) as info:
        parse_manifests(bad)
    assert any(
        p.startswith("line 1: network.allow:") and "HOST:PORT" in p for p in info.value.problems
    )
    assert any(p.startswith("line 2: network.deny:") for p in info.value.problems)


def test_a_manifest_without_network_keeps_its_digest() -> None:
    manifest = Manifest.model_validate({"episode_id": "a", "seed": 1, "policy": {"id": "p"}})
    # computed before ``network`` became a typed field: unchanged
    assert manifest.digest() == (
        "sha256:46dd259dd24139ad8a24019f277a5c36b658eec69c0b505b4d335a9a9803d1fe"
    )
    networked = manifest.model_copy(update={"network": NetworkRequest(allow=["a.test:1"])})
    assert networked.digest() != manifest.digest()
    assert networked.guest_view()["network"] == {"allow": ["a.test:1"]}

"""Manifest files are validated whole, before anything runs; problems name line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cleanroom.core.limits import Limits
from cleanroom.errors import ManifestError
from cleanroom.evidence.manifest import (
    Manifest,
    NetworkRequest,
    check_groups,
    coerce_manifests,
    describe,
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


def test_a_seed_given_as_text_is_refused() -> None:
    """``"seed": "3"`` used to be read as 3: the seed is a JSON integer, nothing else."""
    for seed in ("3", 3.0, True):
        with pytest.raises(ManifestError, match="line 1: seed"):
            parse_manifests(_lines({**GOOD, "seed": seed}))


def test_values_json_cannot_carry_are_refused_with_line_and_field() -> None:
    """NaN/Infinity (accepted by ``json.loads``, then failing every export), a 5000-digit seed
    (``ValueError``) and a 100k-deep task (``RecursionError``) are refused up front (15 §9)."""
    head = '{"episode_id": "e%d", "seed": 1, "policy": {"id": "p"}, "task": '
    text = "\n".join(
        [
            head % 1 + '{"a": [1, NaN]}}',
            head % 2 + '{"b": {"c": -Infinity}}}',
            '{"episode_id": "e3", "seed": ' + "7" * 5000 + ', "policy": {"id": "p"}}',
            head % 4 + "[" * 100_000 + "]" * 100_000 + "}",
            head % 5 + '{"k": ' * 150 + "1" + "}" * 150 + "}",
            head % 6 + '{"x": 1e999}}',
        ]
    )
    with pytest.raises(ManifestError) as info:
        parse_manifests(text)
    problems = info.value.problems
    assert problems[0].startswith("line 1: task.a.1: nan is not a JSON number"), problems
    assert problems[1].startswith("line 2: task.b.c: -inf is not a JSON number"), problems
    assert problems[2] == "line 3: seed: an integer of 5000 digits (at most 4300)"
    assert problems[3] == "line 4: task: nested deeper than 100 levels"
    assert problems[4].startswith("line 5: task.k.k.k...: nested deeper than 100 levels")
    assert problems[5].startswith("line 6: task.x: inf is not a JSON number")


def test_python_values_json_cannot_carry_are_refused_by_index() -> None:
    """The Python API gets the same checks (without recursing into a 100k-deep dict)."""
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(100_000):
        node["d"] = {}
        node = node["d"]
    items = [
        GOOD,
        {**GOOD, "episode_id": "n", "task": {"r": float("nan")}},
        {**GOOD, "episode_id": "d", "task": deep},
        {**GOOD, "episode_id": "p", "policy": {"id": "p", "params": {"lr": float("inf")}}},
    ]
    with pytest.raises(ManifestError) as info:
        coerce_manifests(items)
    assert info.value.problems == [
        "item 1: task.r: nan is not a JSON number (NaN and Infinity are refused)",
        "item 2: task.d.d.d...: nested deeper than 100 levels",
        "item 3: policy.params.lr: inf is not a JSON number (NaN and Infinity are refused)",
    ]
    with pytest.raises(ValidationError, match=r"task\.r"):  # any way a Manifest is made
        Manifest.model_validate({**GOOD, "task": {"r": float("nan")}})


def test_dicts_and_manifests_mix_and_are_checked_like_lines() -> None:
    """``coerce_manifests`` takes both kinds; problems are named by index and field."""
    parsed = coerce_manifests([GOOD, Manifest.model_validate({**GOOD, "episode_id": "m"})])
    assert [m.episode_id for m in parsed] == ["ep-1", "m"]
    with pytest.raises(ManifestError) as info:
        coerce_manifests([GOOD, {**GOOD, "seed": "1"}, GOOD, "x"])  # type: ignore[list-item]
    assert info.value.problems == [
        "item 1: seed: Input should be a valid integer",
        "item 2: episode_id: 'ep-1' already used on item 0",
        "item 3: must be a JSON object",
    ]


def test_errors_name_the_file_and_skip_only_blank_and_comment_lines(tmp_path: Path) -> None:
    """The error names the file it came from (``<manifests>`` for a text); a blank line or an
    indented ``#`` comment is skipped and checking goes on past it; a top-level problem says
    ``(manifest)``; the invalid input itself (it may be huge) is never quoted back."""
    path = tmp_path / "batch.jsonl"
    huge = "x" * 5000
    path.write_text(
        _lines(GOOD, "", "   # an indented comment", {**GOOD, "episode_id": "ep-2", "seed": huge})
    )
    with pytest.raises(ManifestError) as info:
        load_manifests(path)
    assert str(info.value).startswith(f"{path}: 1 problem(s)")
    assert info.value.problems[0].startswith("line 4: seed:")
    assert huge not in " ".join(info.value.problems)
    with pytest.raises(ManifestError) as info:
        parse_manifests(_lines(GOOD, GOOD))
    assert str(info.value).startswith("<manifests>: 1 problem(s)")
    text = "é" * 3  # read as UTF-8 whatever the locale
    path.write_text(_lines({**GOOD, "task": {"name": text}}), encoding="utf-8")
    assert load_manifests(path)[0].task == {"name": text}


def test_a_problem_of_the_whole_manifest_says_manifest() -> None:
    with pytest.raises(ValidationError) as info:
        Manifest.model_validate({"seed": 1, "policy": {"id": "p"}})  # no episode_id
    assert describe(info.value) == ["episode_id: Field required"]
    with pytest.raises(ValidationError) as info:
        Manifest.model_validate([1])
    assert describe(info.value)[0].startswith("(manifest): ")


def _grouped(eid: str, group: str = "g", cmd: str = "prep", **limits: int) -> dict[str, Any]:
    setup = {"command": [cmd]}
    return {**GOOD, "episode_id": eid, "group": {"id": group, "setup": setup}, "limits": limits}


def test_episodes_of_a_group_that_disagree_are_refused_naming_each_line() -> None:
    """Protects: a group's clones restore one warm env, so every episode of a group must share
    its setup, baseline, vcpus and memory; each one that differs from the group's first is
    refused, naming its line, the group, what differs and the line it differs from. Episodes
    of other groups, or of none, are not compared with it."""
    text = _lines(
        _grouped("a", vcpus=1),
        _grouped("b", vcpus=2, memory_mib=512),
        _grouped("c", vcpus=1),
        {**GOOD, "episode_id": "d", "limits": {"vcpus": 4}},
        _grouped("e", group="h", vcpus=4),
        _grouped("f", cmd="other", vcpus=1),
    )
    with pytest.raises(ManifestError) as err:
        parse_manifests(text, source="m.jsonl")
    shared = " (every episode of a group shares one setup and one machine)"
    assert err.value.problems == [
        "line 2: group 'g': limits.vcpus, limits.memory_mib differ(s) from line 1" + shared,
        "line 6: group 'g': group differ(s) from line 1" + shared,
    ]


def test_check_groups_names_episodes_without_lines() -> None:
    """Protects: manifests given as objects (the API) are checked the same way; each problem
    names the episodes, and nothing is refused when the group agrees."""
    same = [Manifest.model_validate(_grouped(e, vcpus=1)) for e in ("a", "b")]
    check_groups(same)  # agrees: no error
    other = Manifest.model_validate({**_grouped("z", vcpus=1), "baseline": "sha256:" + "1" * 64})
    with pytest.raises(ManifestError) as err:
        check_groups([*same, other])
    assert err.value.problems == [
        "episode 'z': group 'g': baseline differ(s) from episode 'a' (every episode of a group"
        " shares one setup and one machine)"
    ]


def test_a_verifier_or_a_group_changes_the_digest() -> None:
    """Protects: provenance tells a manifest with a verifier or a group from the same one
    without (only an absent one is left out of the digest)."""
    plain = Manifest.model_validate(GOOD).digest()
    checked = {**GOOD, "verifier": {"command": ["check"]}}
    assert Manifest.model_validate(checked).digest() != plain
    assert Manifest.model_validate(_grouped("ep-1")).digest() != plain


def test_the_guest_never_sees_the_verifier() -> None:
    """Protects: the guest's manifest.json is the manifest as JSON without its verifier (the
    episode has no business with its check)."""
    m = Manifest.model_validate({**GOOD, "verifier": {"command": ["check", "--secret-rule"]}})
    view = m.guest_view()
    assert "verifier" not in view and view["episode_id"] == "ep-1"
    assert json.loads(json.dumps(view)) == view


def test_limits_fall_back_field_by_field() -> None:
    """Protects: each limit the manifest leaves unset comes from the baseline's defaults, and
    only then from the built-in ones; a set one always wins."""
    own = Limits(timeout_s=5, memory_mib=256)
    defaults = Limits(timeout_s=50, vcpus=2, output_quota_mib=7)
    got = own.merged_over(defaults)
    assert (got.timeout_s, got.vcpus, got.memory_mib, got.output_quota_mib) == (5, 2, 256, 7)
    builtin = Limits().merged_over(Limits())
    assert Limits(vcpus=3).merged_over(Limits()).vcpus == 3
    assert Limits().merged_over(Limits(memory_mib=128)).timeout_s == builtin.timeout_s


def test_problems_never_echo_the_value_given() -> None:
    """Protects: a refused field's problem names the place and the rule, not the value (it
    may be a secret pasted in the wrong place), and objects given to the API are named
    "manifests: item N"."""
    bad = {**GOOD, "seed": "tok_DoNotEchoMe"}
    with pytest.raises(ManifestError) as err:
        coerce_manifests([bad])
    assert "tok_DoNotEchoMe" not in str(err.value)
    assert str(err.value).startswith("manifests: ") and err.value.problems[0].startswith(
        "item 0: seed"
    )

"""Manifest input that validated and broke later is refused when validated (issue 30).

- ``episode_id`` ``"x\\n"``: a regex ``$`` matches before a final newline, so the id passed and
  made a store folder with a newline in its name. Every ``*_RE`` in ``src/`` now matches whole.
- A lone surrogate (``"\\ud800"``, valid JSON escape, no UTF-8 form) in ``task`` (or any field,
  or a key) passed, then ``cleanroom inspect`` crashed with a traceback printing the record.
- A key given twice on one line silently kept the last value; now refused naming the key and line.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cleanroom.errors import ManifestError
from cleanroom.evidence.manifest import coerce_manifests, parse_manifests

SRC = Path(__file__).resolve().parents[2] / "src" / "cleanroom"


def ep(**extra: object) -> dict[str, object]:
    return {"episode_id": "a", "seed": 1, "policy": {"id": "p"}, **extra}


def problems(line: str) -> list[str]:
    with pytest.raises(ManifestError) as caught:
        parse_manifests(line)
    return caught.value.problems


@pytest.mark.parametrize("bad", ["x\n", "a\n", "x\r", "x\n\n", "\nx"])
def test_an_id_with_a_newline_is_refused(bad: str) -> None:
    with pytest.raises(ManifestError, match="episode_id: "):
        coerce_manifests([ep(episode_id=bad)])
    group = {"id": bad, "setup": {"command": ["true"]}}
    with pytest.raises(ManifestError, match=r"group\.id: "):
        coerce_manifests([ep(group=group)])
    with pytest.raises(ManifestError, match="baseline: "):
        coerce_manifests([ep(baseline="sha256:" + "0" * 64 + "\n")])


def test_every_anchored_regex_in_src_matches_whole() -> None:
    """No module-level ``*_RE`` ends in a bare ``$`` (without MULTILINE, ``$`` also matches
    before a final newline): each uses ``\\Z``, or is a search pattern with no end anchor."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            call = node.value
            if not names or not names[0].endswith("_RE") or not call.args:
                continue
            pattern = call.args[0]
            assert isinstance(pattern, ast.Constant), f"{path}: {names[0]}"
            multiline = any("MULTILINE" in ast.unparse(a) for a in call.args[1:])
            raw = pattern.value
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            found.append(names[0])
            if text.endswith("$") and not multiline:
                pytest.fail(f"{path.relative_to(SRC)}: {names[0]} ends in '$': use \\Z")
    assert {"EPISODE_ID_RE", "DIGEST_RE", "LABEL_RE", "NAME_RE", "HEX_RE"} <= set(found)


def test_other_newline_ids_are_refused() -> None:
    from cleanroom.baseline import spec, store
    from cleanroom.network.policy import normalize_name

    assert normalize_name("example.com") == "example.com"
    assert normalize_name("example\n.com") is None
    assert not spec.NAME_RE.match("tiny\n") and spec.NAME_RE.match("tiny")
    assert not store.HEX_RE.match("ab\n") and store.HEX_RE.match("ab")


@pytest.mark.parametrize(
    ("field", "line"),
    [
        ("task.text", ep(task={"text": "\ud800"})),
        ("task.list.1", ep(task={"list": ["ok", "a\udfffb"]})),
        ("policy.id", ep(policy={"id": "p\udc80"})),
        ("task.\\ud800k", ep(task={"\ud800k": 1})),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(field: str, line: dict[str, object]) -> None:
    text = json.dumps(line)  # ensure_ascii: the surrogate is a \\udXXX escape, valid JSON
    (problem,) = problems(text)
    assert problem.startswith(f"line 1: {field}: a lone surrogate")
    problem.encode("utf-8")  # the message itself is printable
    with pytest.raises(ManifestError, match=re.escape(field)):
        coerce_manifests([line])  # a dict from the Python API too
    # a surrogate pair is a real character, and welcome
    (ok,) = parse_manifests(json.dumps(ep(task={"text": "\U0001f600"})))
    assert ok.task["text"] == "\U0001f600"


def test_a_key_given_twice_is_refused_naming_it_and_the_line() -> None:
    lines = [
        '{"episode_id": "ok", "seed": 1, "policy": {"id": "p"}}',
        '{"episode_id": "a", "seed": 1, "seed": 2, "policy": {"id": "p"}}',
        '{"episode_id": "b", "seed": 1, "policy": {"id": "p"}, "task": {"x": {"k": 1, "k": 2}}}',
    ]
    with pytest.raises(ManifestError) as caught:
        parse_manifests("\n".join(lines))
    assert caught.value.problems == [
        "line 2: key 'seed' is given more than once",
        "line 3: task.x: key 'k' is given more than once",
    ]


def test_inspect_prints_a_record_holding_a_surrogate(tmp_path: Path) -> None:
    """A record an older version wrote (it accepted the surrogate) is printed as its JSON
    escape, not a ``UnicodeEncodeError`` traceback; an unreadable record is a one-line error."""
    home = tmp_path / "home"
    env = {**os.environ, "CLEANROOM_HOME": str(home), "CI": "true", "PYTHONIOENCODING": "utf-8"}
    code = (
        "from cleanroom.cli import open_store\n"
        "open_store(None).put_record('r1', 'a', {'episode_id': 'a', 'task': '\\ud800', 'n': 'é'})\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True)

    def inspect() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "cleanroom", "inspect", "a", "--run-id", "r1"]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)

    shown = inspect()
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {"episode_id": "a", "task": "\ud800", "n": "é"}
    (record,) = home.glob("store/runs/r1/episodes/a/result.json")
    record.write_text("{")
    broken = inspect()
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "unreadable result record" in broken.stderr

"""A RUN request the guest agent cannot take is refused before anything runs (issue 30).

The RUN request (manifest, the baseline's entry and Env, secrets) travels as one frame header;
the agent refuses one over ``protocol.MAX_HEADER`` and closes the channel, so a 300 KiB ``task``
or an image whose ``Env`` is over 256 KiB validated and built, then ended every attempt (and
every resume) ``env_crashed``. Now: the manifest is refused when validated (``ManifestError``
naming the field), the baseline's entry with a ``BuildError``, the whole request (with secret
values) by the run's preflight, before any env; and the host never sends a header the agent
would refuse (``FrameTooLarge``, the channel intact). The fake driver runs the real C agent.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import cleanroom
from cleanroom.agent import protocol
from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import BuildError, ManifestError
from cleanroom.evidence import header_budget
from cleanroom.evidence.manifest import coerce_manifests, parse_manifests
from cleanroom.host.digests import digest_of
from cleanroom.ledger import Ledger

from ..conftest import make_fake_baseline

KIB = 1024


@pytest.fixture
def baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Baseline:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    return make_fake_baseline(tmp_path)


def ep(eid: str, **extra: Any) -> dict[str, Any]:
    return {"episode_id": eid, "seed": 1, "policy": {"id": "p"}, **extra}


def test_a_300_kib_task_is_refused_naming_the_field() -> None:
    line = json.dumps(ep("big", task={"text": "x" * 300 * KIB}))
    with pytest.raises(ManifestError) as caught:
        parse_manifests(line)
    (problem,) = caught.value.problems
    assert problem.startswith("line 1: task: the manifest is ")
    assert f"at most {header_budget.MANIFEST_MAX}" in problem
    # counted as the wire carries it: a non-ASCII character is a 6-byte escape
    with pytest.raises(ManifestError, match=r"item 0: task: "):
        coerce_manifests([ep("wide", task={"text": "é" * 40 * KIB})])


def test_a_task_within_its_share_is_accepted() -> None:
    (manifest,) = parse_manifests(json.dumps(ep("fits", task={"text": "x" * 180 * KIB})))
    assert len(manifest.task["text"]) == 180 * KIB


def test_an_entry_over_its_share_is_a_build_error() -> None:
    env = {"BIG": "v" * (header_budget.ENTRY_MAX + 1)}
    with pytest.raises(BuildError, match=r"^image x: the image's entrypoint, workdir and Env"):
        header_budget.check_entry("image x", ["/bin/true"], env, "/work")
    header_budget.check_entry("image x", ["/bin/true"], {"SMALL": "v" * 1000}, "/work")


def test_the_host_never_sends_a_header_the_agent_refuses() -> None:
    with pytest.raises(protocol.TooLarge, match="not sent"):
        protocol.encode(1, {"pad": "x" * protocol.MAX_HEADER})
    assert protocol.encode(1, {"pad": "x" * (protocol.MAX_HEADER - 20)})


def test_a_run_whose_request_is_too_large_is_refused_before_any_env(
    baseline: Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """150 KiB of task (within its share) and a 60 KiB secret (sent twice) are over 256 KiB:
    without the preflight every attempt ended ``env_crashed`` ("header too large")."""
    monkeypatch.setenv("SECRET_BLOB", "s" * 60 * KIB)
    items = [ep("small"), ep("big", task={"text": "x" * 150 * KIB}, secrets=["SECRET_BLOB"])]
    with pytest.raises(ManifestError, match=r"1 manifest\(s\) too large to run") as caught:
        cleanroom.run(items, baseline=baseline, driver="fake", secrets_from="env")
    (problem,) = caught.value.problems
    assert problem.startswith("episode 'big': the RUN request is ")
    assert "secret_files" in problem and "manifest" in problem
    with Ledger() as ledger:  # refused before any episode was queued or any env created
        assert not ledger.list_runs() or not any(
            ledger.episodes(r.run_id) for r in ledger.list_runs()
        )
    # the same task without the secret runs (it is within its share)
    alone = ep("big", task={"text": "x" * 150 * KIB})
    result = cleanroom.run([alone], baseline=baseline, driver="fake")
    assert [e.outcome.value for e in result.episodes] == ["completed"]


def test_a_baseline_whose_env_is_too_large_is_refused_by_a_run(baseline: Baseline) -> None:
    big_env = [f"VAR{i}=" + "v" * 1000 for i in range(300)]  # ~300 KiB of image Env
    image = dataclasses.replace(baseline, image={"env": big_env})
    digest = digest_of(image.identity())
    folder = baseline.path.parent / digest.removeprefix("sha256:")
    shutil.copytree(baseline.path, folder)
    huge = dataclasses.replace(image, digest=digest, path=folder)
    (folder / "baseline.json").write_text(json.dumps(huge.to_json()))
    with pytest.raises(BuildError, match=r"^baseline sha256:\w+: the image's entrypoint"):
        cleanroom.run([ep("a")], baseline=huge, driver="fake")

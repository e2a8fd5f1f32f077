"""Shared fixtures.

``CLEANROOM_HOME`` points at ``.cache/test-home`` in the checkout for the whole session, so the
kernel download, the rootfs cache and the tiny baseline are built once and reused by later runs
(the folder is gitignored). Tests that need their own ledger or store make them in tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_HOME = ROOT / ".cache" / "test-home"
TINY_SPEC = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
TINY_ENTRY = ROOT / "tests" / "baselines" / "tiny" / "files" / "entry.py"

os.environ.setdefault("CLEANROOM_HOME", str(TEST_HOME))


def make_fake_baseline(tmp: Path, script: Path = TINY_ENTRY) -> "Baseline":  # noqa: UP037
    """A baseline for the fake driver: the tiny entry script (or ``script``) run by the host's
    Python.

    The script is a component (hard-linked into the baseline folder), so drift tests work.
    """
    from cleanroom.baseline.model import Baseline, Component, identity
    from cleanroom.digests import digest_of, sha256_file
    from cleanroom.manifest import Limits

    entry = tmp / "entry" / "entry.py"
    entry.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(script, entry)
    component = Component("entry.py", entry.stat().st_size, sha256_file(entry))
    ident = identity(
        (component,),
        (sys.executable, str(entry)),
        Limits(timeout_s=30),
        "host",
        "0.1.0",
        "sha256:" + "0" * 64,
    )
    digest = digest_of(ident)
    folder = tmp / "baselines" / digest.removeprefix("sha256:")
    folder.mkdir(parents=True)
    os.link(entry, folder / "entry.py")
    baseline = Baseline(
        digest,
        folder,
        ident["spec_digest"],
        "fake",
        (component,),
        tuple(ident["entrypoint"]),
        Limits(timeout_s=30),
        "host",
        "0.1.0",
    )
    (folder / "baseline.json").write_text(json.dumps(baseline.to_json()))
    return baseline


def with_network(baseline: "Baseline", allow: list[str], tmp: Path) -> "Baseline":  # noqa: UP037
    """``baseline`` with an egress allowlist: a new baseline (its own digest, which covers the
    list) whose components are hard links to the original's, so nothing is rebuilt."""
    import dataclasses

    from cleanroom.digests import digest_of

    spec = {**baseline.spec, "network": {"allow": list(allow)}}
    derived = dataclasses.replace(baseline, network=tuple(allow), spec=spec)
    derived = dataclasses.replace(derived, digest=digest_of(derived.identity()))
    folder = tmp / "baselines" / derived.digest.removeprefix("sha256:")
    folder.mkdir(parents=True)
    for component in baseline.components:
        os.link(baseline.path / component.name, folder / component.name)
    derived = dataclasses.replace(derived, path=folder)
    (folder / "baseline.json").write_text(json.dumps(derived.to_json()))
    return derived


@pytest.fixture(scope="session")
def tiny_baseline() -> Iterator["Baseline"]:  # noqa: UP037
    """The tiny test baseline, built once (minutes on a fresh machine) and cached."""
    from cleanroom.baseline.store import resolve_or_build

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (run `make setup`)")
    yield resolve_or_build(str(TINY_SPEC), progress=lambda step, detail: print(step, detail))


def _gvisor_unusable(tmp: Path) -> str | None:
    """Why runsc cannot run a sandbox here, or None if it can."""
    if shutil.which("runsc") is None:
        return "runsc is not installed (apt-get install runsc)"
    try:
        proc = subprocess.run(
            ["runsc", f"--root={tmp}", "--network=none", "do", "true"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"runsc cannot run here: {exc}"
    if proc.returncode != 0:
        return f"runsc cannot run a sandbox here: {proc.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="session")
def gvisor_usable(tmp_path_factory: pytest.TempPathFactory) -> None:
    reason = _gvisor_unusable(tmp_path_factory.mktemp("runsc-probe"))
    if reason:
        pytest.skip(reason)


if False:  # pragma: no cover - typing only
    from cleanroom.baseline.model import Baseline

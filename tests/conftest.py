"""Shared fixtures, and a session the caller's environment cannot steer.

``CLEANROOM_HOME`` is always ``.cache/test-home`` in the checkout (never a home the caller
exported: the suite reaps), so the kernel download, the rootfs cache and the tiny baseline are
built once and reused by later runs (the folder is gitignored); every other ``CLEANROOM_*``
variable is unset for the session; a SIGINT the caller ignores (a non-interactive shell's
``cmd &`` does) is the default again, so the Ctrl-C tests' CLIs get their ^C. Tests that need
their own ledger or store make them in tmp_path. With ``CI=true`` a skipped test fails unless
``tests/skips_allowed.txt`` names it, with a reason.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_HOME = ROOT / ".cache" / "test-home"
TINY_SPEC = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
TINY_ENTRY = ROOT / "tests" / "baselines" / "tiny" / "files" / "entry.py"

SKIPS_ALLOWED = ROOT / "tests" / "skips_allowed.txt"

for _name in [n for n in os.environ if n.startswith("CLEANROOM_")]:
    del os.environ[_name]
os.environ["CLEANROOM_HOME"] = str(TEST_HOME)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # inherited: children would ignore it too
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _umask_restored() -> Iterator[None]:
    """The CLI and the API narrow the process's umask (``private.check_home``); a test that
    runs them in-process does not pass that on to the tests after it."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield
    os.umask(previous)


def allowed_skips(path: Path) -> dict[str, str]:
    """``pattern -> reason`` from the allowlist (``PATTERN  -- REASON`` per line, ``#`` comments);
    a line without a reason is refused."""
    allowed: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pattern, _, reason = (part.strip() for part in line.partition(" -- "))
        if not pattern or not reason:
            raise pytest.UsageError(f"{path.name}:{number}: needs 'PATTERN -- REASON'")
        allowed[pattern] = reason
    return allowed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """Under ``CI=true`` a skip is a failure unless the allowlist names the test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    if any(fnmatch.fnmatchcase(item.nodeid, p) for p in allowed_skips(SKIPS_ALLOWED)):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, and not in tests/{SKIPS_ALLOWED.name}: {reason}"


def make_fake_baseline(tmp: Path, script: Path = TINY_ENTRY) -> "Baseline":  # noqa: UP037
    """A baseline for the fake driver: the tiny entry script (or ``script``) run by the host's
    Python. The script is a component (hard-linked into the baseline folder), so drift tests
    work."""
    from cleanroom.core.baseline_model import Baseline, Component, identity
    from cleanroom.core.limits import Limits
    from cleanroom.host.digests import digest_of, sha256_file

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


def seed_agent_cache(home: Path) -> None:
    """Give the fresh home ``home`` the fake driver's agent already built (hard links to the
    suite's own), so a test that starts nodes with their own homes does not wait for gcc."""
    from cleanroom.agent import native

    saved = os.environ["CLEANROOM_HOME"]
    os.environ["CLEANROOM_HOME"] = str(TEST_HOME)
    try:
        built = native.host_binary().parent
    finally:
        os.environ["CLEANROOM_HOME"] = saved
    dest = home / "cache" / "agent" / built.name
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(built, dest, ignore=ignore, copy_function=os.link, dirs_exist_ok=True)


def with_network(baseline: "Baseline", allow: list[str], tmp: Path) -> "Baseline":  # noqa: UP037
    """``baseline`` with an egress allowlist: a new baseline (its own digest, which covers the
    list) whose components are hard links to the original's, so nothing is rebuilt."""
    import dataclasses

    from cleanroom.host.digests import digest_of

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
    from cleanroom.baseline.resolve import resolve_or_build

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
    from cleanroom.core.baseline_model import Baseline

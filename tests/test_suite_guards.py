"""The suite cannot be fooled by its environment (issue 21 §4).

Protects: a caller's exported ``CLEANROOM_HOME`` (the suite reaps!) or other ``CLEANROOM_*``
settings never reach the tests; under ``CI=true`` a skipped test fails unless the allowlist
names it with a reason. Each runs a small pytest session of its own over ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ROOT, TEST_HOME, allowed_skips

pytest_plugins = ["pytester"]

USE_OUR_CONFTEST = "from tests.conftest import *  # noqa: F403\n"


@pytest.fixture
def session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytest session in a temp folder whose conftest is the suite's."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(USE_OUR_CONFTEST)
    return pytester


def test_the_test_home_wins_over_an_exported_home_and_other_settings_are_unset(
    session: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "my-real-home"))
    monkeypatch.setenv("CLEANROOM_ACCEL", "kvm")
    monkeypatch.setenv("CLEANROOM_QEMU_START", "cold")
    session.makepyfile(
        f"""
        import os
        def test_env():
            assert os.environ["CLEANROOM_HOME"] == {str(TEST_HOME)!r}
            assert [n for n in os.environ if n.startswith("CLEANROOM_")] == ["CLEANROOM_HOME"]
        """
    )
    session.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


SKIPPING = """
import pytest
def test_skips():
    pytest.skip("no widget here")
def test_passes():
    pass
"""


def test_under_ci_a_skip_fails_naming_the_reason(
    session: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    session.makepyfile(SKIPPING)
    monkeypatch.delenv("CI", raising=False)
    session.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=1)
    monkeypatch.setenv("CI", "true")
    result = session.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*skipped under CI=true, and not in tests/skips_allowed.txt*"])
    result.stdout.fnmatch_lines(["*no widget here*"])


def test_under_ci_an_allowed_skip_stays_a_skip(
    session: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text("# comment\n*::test_skips -- the widget is optional\n")
    session.makeconftest(
        USE_OUR_CONFTEST + f"import tests.conftest as c\nc.SKIPS_ALLOWED = c.Path({str(allow)!r})\n"
    )
    session.makepyfile(SKIPPING)
    monkeypatch.setenv("CI", "true")
    session.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=1)


def test_every_allowed_skip_has_a_reason(tmp_path: Path) -> None:
    assert all(allowed_skips(ROOT / "tests" / "skips_allowed.txt").values())
    bad = tmp_path / "bad.txt"
    bad.write_text("tests/x.py::test_y\n")
    with pytest.raises(pytest.UsageError, match=r"bad\.txt:1: needs 'PATTERN -- REASON'"):
        allowed_skips(bad)

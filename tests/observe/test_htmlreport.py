"""The HTML report: self-contained, every chart present, one timeline bar per env.

Rendered from a real (fake-driver) run; parsed with the standard library, and loaded in headless
Chromium when it is installed (Debian's ``chromium``; scripts/setup.sh installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cleanroom.batch.result import RunResult
from cleanroom.core.states import Outcome
from cleanroom.evidence.manifest import Manifest
from cleanroom.observe.htmlreport import render_html, write_html

from .conftest import Observed
from .test_metrics import NeverGone

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHARTS = ("chart-outcomes", "chart-rewards", "chart-timeline", "chart-cleanup")
PHASES = ("hist-queue", "hist-provision", "hist-run", "hist-export")


def policy_manifest(eid: str, policy: str, seed: int, **task: Any) -> Manifest:
    return Manifest.model_validate(
        {"episode_id": eid, "seed": seed, "policy": {"id": policy, "version": "2"}, "task": task}
    )


class Elements(HTMLParser):
    """Every start tag with its attributes, and the page's text."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if "id" in a}

    def with_class(self, cls: str) -> list[dict[str, str]]:
        return [a for _, a in self.tags if cls in a.get("class", "").split()]


async def run_batch(obs: Observed, run_id: str) -> RunResult:
    batch = [
        policy_manifest("a-0", "alpha", 2),
        policy_manifest("a-1", "alpha", 4),
        policy_manifest("b-0", "beta", 6),
        policy_manifest("b-1", "beta", 8, mode="fail"),
    ]
    return await obs.ctl.run(batch, obs.baseline, run_id=run_id)


def check_report_dom(dom: str, n_envs: int, leaked: int = 0) -> Elements:
    page = Elements(dom)
    ids = page.ids()
    for chart in (*CHARTS, *PHASES):
        assert chart in ids, chart
    svgs = [a for tag, a in page.tags if tag == "svg"]
    assert len(svgs) >= len(CHARTS) + len(PHASES)
    bars = page.with_class("env-bar")
    assert len(bars) == n_envs
    assert len({b["data-env-id"] for b in bars}) == n_envs
    assert len(page.with_class("leaked")) == leaked
    assert len(page.with_class("bar")) == len(Outcome)  # one per outcome, zeros included
    return page


async def test_report_of_a_run_has_every_chart(obs: Observed, tmp_path: Path) -> None:
    obs.observe(lambda kind, data: None)
    result = await run_batch(obs, "h1")
    assert result.counts() == {"completed": 3, "episode_error": 1}
    html = render_html("h1", obs.ledger, obs.store)
    page = check_report_dom(html, n_envs=4)
    # rewards: a dot per rewarded episode (the failed one has none), grouped per policy
    assert len(page.with_class("reward-dot")) == 3
    text = " ".join(page.text)
    assert "alpha@2" in text and "beta@2" in text
    assert re.search(r"provision \(create → agent ready\)[^<]* — 4 cold", html)  # fake: booted
    assert "No orphans, no leaks." in text
    assert "every env confirmed absent (4/4)" in text
    # self-contained: no script, no external resource of any kind
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "@import" not in html and "url(" not in html


async def test_leaked_env_is_drawn_and_listed(tmp_path: Path) -> None:
    driver = NeverGone(run_root=tmp_path / "run")
    obs = Observed(tmp_path, driver)
    obs.observe(lambda kind, data: None, cleanup_window_s=0.2)
    try:
        await obs.ctl.run([policy_manifest("x", "p", 1)], obs.baseline, run_id="h2")
        html = render_html("h2", obs.ledger, obs.store)
    finally:
        from cleanroom.drivers.fake import FakeDriver

        for env in obs.ledger.envs(run_id="h2"):
            await FakeDriver.destroy(driver, env.env_id)
        obs.ledger.close()
    page = check_report_dom(html, n_envs=1, leaked=1)
    assert "leaks" in page.ids()
    assert "1 env(s) NOT confirmed absent" in " ".join(page.text)
    assert page.with_class("span-leaked")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
async def test_chromium_renders_the_report(obs: Observed, tmp_path: Path) -> None:
    obs.observe(lambda kind, data: None)
    await run_batch(obs, "h3")
    page = tmp_path / "report.html"
    write_html("h3", obs.ledger, obs.store, page)
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    assert CHROMIUM is not None
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    check_report_dom(dom, n_envs=4)
    shot = tmp_path / "report.png"
    subprocess.run(
        [CHROMIUM, *flags, "--window-size=820,1600", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


async def test_cli_report_writes_html_and_json(
    obs: Observed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cleanroom.cli import app

    obs.observe(lambda kind, data: None)
    await run_batch(obs, "h4")
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))  # the harness's ledger.db and store
    html, js = tmp_path / "out" / "r.html", tmp_path / "out" / "r.json"
    result = CliRunner().invoke(
        app,
        ["report", "h4", "--html", str(html), "--json", str(js), "--store", str(obs.tmp / "store")],
    )
    assert result.exit_code == 0, result.output
    check_report_dom(html.read_text(), n_envs=4)
    data = json.loads(js.read_text())
    assert data["run_id"] == "h4" and data["summary"]["outcomes"]["completed"] == 3
    missing = CliRunner().invoke(app, ["report", "nope", "--html", str(html)])
    assert missing.exit_code == 2

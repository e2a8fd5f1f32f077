"""``cleanroom report RUN_ID --html FILE``: one self-contained HTML page about a run.

Everything is inline (CSS and SVG drawn here in Python; no script, no font, no network): outcome
breakdown, reward distribution per policy, a latency histogram per phase, cleanup latency with
any env not confirmed absent, and a timeline with one bar per env from its intent (written
before the VM existed) to its confirmed absence. Data: ``run_report_json`` plus the ledger's env
rows and events.
"""

from __future__ import annotations

import time
from html import escape
from pathlib import Path
from typing import Any

from cleanroom import charts
from cleanroom.errors import ConfigError
from cleanroom.ledger import EnvRow, Ledger
from cleanroom.report import OUTCOMES, percentile, run_report_json
from cleanroom.store import Store

OUTCOME_COLOURS = {
    "completed": "#2f9e5b",
    "episode_error": "#e0a21b",
    "timeout": "#e07b1b",
    "cancelled": "#8a8f98",
    "env_crashed": "#d9480f",
    "infra_error": "#c92a2a",
    "export_failed": "#862e9c",
}
PHASE_COLOURS = {
    "queue_s": "#adb5bd",
    "provision_s": "#4c6ef5",
    "run_s": "#2f9e5b",
    "export_s": "#1098ad",
    "verify_s": "#7048e8",
    "destroy_s": "#e8590c",
}
PHASE_NAMES = {
    "queue_s": "queue (waiting for a slot)",
    "provision_s": "provision (create → agent ready)",
    "run_s": "run (manifest sent → output collected)",
    "export_s": "export (evidence → durable store)",
    "verify_s": "verify (verifier on the evidence)",
    "destroy_s": "destroy + confirm absent",
}
POLICY_COLOURS = ("#4c6ef5", "#2f9e5b", "#e8590c", "#862e9c", "#1098ad", "#c2255c", "#5c940d")
LEAKED = "#c92a2a"
NOTABLE_EVENTS = ("env_leaked", "env_unknown", "export_failed", "run_resumed")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;margin:0;
background:#f4f5f7}
main{max-width:780px;margin:0 auto;padding:18px}
h1{font-size:20px;margin:4px 0 2px}h2{font-size:16px;margin:0 0 8px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:12px 14px;margin:12px 0}
.meta{color:#555;font-size:12.5px}.meta b{color:#222}
.ok{color:#2f9e5b;font-weight:600}.bad{color:#c92a2a;font-weight:600}
table{border-collapse:collapse;font-size:12px;width:100%}
td,th{padding:2px 6px;border-bottom:1px solid #eee;text-align:left}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.chart text{font-family:inherit;fill:#333}.chart .tick,.chart .dim{fill:#777}
.chart .value{fill:#444}.chart .mark-label{fill:#333;font-size:10px}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.phase h3{font-size:13px;margin:8px 0 0;font-weight:600}
"""


def _span_pieces(env: EnvRow, t0: float, end: float) -> tuple[charts.Span, ...]:
    """An env's life as coloured spans: provisioning, running, destroying, leaked or unfinished."""

    def s(a: float, b: float, phase: str, colour: str) -> charts.Span:
        return charts.Span(a - t0, max(b, a) - t0, phase, colour)

    ready = env.ready_at or env.created_at
    stop = env.destroy_started_at
    pieces = [s(env.intent_at, ready or stop or end, "provision", PHASE_COLOURS["provision_s"])]
    if ready is not None:
        pieces.append(s(ready, stop or end, "run", PHASE_COLOURS["run_s"]))
    if stop is not None:
        gone = env.confirmed_absent_at or env.destroyed_at or end
        pieces.append(s(stop, gone, "destroy", PHASE_COLOURS["destroy_s"]))
        if env.confirmed_absent_at is None:
            pieces.append(s(gone, end, "leaked", LEAKED))
    return tuple(pieces)


def _lanes(envs: list[EnvRow], t0: float, end: float) -> list[charts.Lane]:
    lanes = []
    for env in envs:
        absent = env.confirmed_absent_at is not None
        life = (env.confirmed_absent_at or end) - env.intent_at
        title = (
            f"{env.env_id} · episode {env.episode_id} (attempt {env.attempt}) · "
            f"{env.accelerator or env.driver or ''} · {charts.fmt_seconds(life)} from intent to "
            + ("confirmed absent" if absent else "NOT confirmed absent")
            + (f" · cleanup {env.cleanup_ms:.1f} ms" if env.cleanup_ms is not None else "")
        )
        label = env.episode_id or env.env_id
        cls = "" if absent else "leaked"
        lanes.append(charts.Lane(env.env_id, label, _span_pieces(env, t0, end), title, cls))
    return lanes


def _legend(items: list[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><i style="background:{c}"></i>{escape(n)}</span>' for n, c in items)
        + "</div>"
    )


def _when(ts: float | None) -> str:
    return "—" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _header(report: dict[str, Any], envs: list[EnvRow]) -> str:
    run = report["run"] or {}
    summary = report["summary"]
    leaked = [e for e in envs if e.confirmed_absent_at is None]
    accel = sorted({e.accelerator for e in envs if e.accelerator})
    wall = (run.get("finished") or 0) - (run.get("created") or 0)
    facts = [
        ("status", run.get("status", "not in the ledger")),
        ("driver", f"{run.get('driver') or '?'} ({', '.join(accel) or 'accelerator unknown'})"),
        ("baseline", run.get("baseline") or "?"),
        ("started", _when(run.get("created"))),
        ("wall time", charts.fmt_seconds(wall) if run.get("finished") else "—"),
        ("episodes", str(summary["episodes"])),
        ("parallel", str(run.get("parallel") or "?")),
    ]
    verdict = (
        f'<span class="ok">every env confirmed absent ({len(envs)}/{len(envs)})</span>'
        if not leaked
        else f'<span class="bad">{len(leaked)} env(s) NOT confirmed absent</span>'
    )
    meta = " · ".join(f"{k} <b>{escape(str(v))}</b>" for k, v in facts)
    return (
        f"<h1>cleanroom run {escape(report['run_id'])}</h1>"
        f'<div class="meta">{meta}</div><div class="meta">{verdict}</div>'
    )


def _outcomes(report: dict[str, Any]) -> str:
    counts = report["summary"]["outcomes"]
    items = [(o, float(counts.get(o, 0)), OUTCOME_COLOURS.get(o, "#999")) for o in OUTCOMES]
    items += [(o, float(n), "#999") for o, n in counts.items() if o not in OUTCOMES]
    return "<h2>Outcomes</h2>" + charts.bar_chart("chart-outcomes", items)


def _rewards(report: dict[str, Any]) -> str:
    groups: dict[str, list[float]] = {}
    for row in report["episodes"]:
        if isinstance(row["reward"], int | float):
            groups.setdefault(row["policy"], []).append(float(row["reward"]))
    data = [
        (policy, values, POLICY_COLOURS[i % len(POLICY_COLOURS)])
        for i, (policy, values) in enumerate(sorted(groups.items()))
    ]
    rows = "".join(
        f'<tr><td>{escape(p)}</td><td class="n">{len(v)}</td>'
        f'<td class="n">{sum(v) / len(v):.4g}</td><td class="n">{percentile(v, 50):.4g}</td>'
        f'<td class="n">{min(v):.4g}</td><td class="n">{max(v):.4g}</td></tr>'
        for p, v, _ in data
    )
    table = (
        '<table><tr><th>policy</th><th class="n">n</th><th class="n">mean</th>'
        f'<th class="n">median</th><th class="n">min</th><th class="n">max</th></tr>{rows}</table>'
    )
    chart = charts.strip_plot("chart-rewards", data, value_name="reward")
    return "<h2>Reward per policy</h2>" + chart + (table if data else "")


def _phase_values(report: dict[str, Any]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for row in report["episodes"]:
        for phase, seconds in row["timings"].items():
            values.setdefault(phase, []).append(seconds)
    return values


def _phase_hist(phase: str, values: list[float], colour: str, element_id: str) -> str:
    marks = [("p50", percentile(values, 50)), ("p95", percentile(values, 95))] if values else []
    return charts.histogram(element_id, values, colour=colour, marks=marks)


def _latencies(report: dict[str, Any]) -> str:
    values = _phase_values(report)
    parts = ["<h2>Latency per phase</h2>"]
    shown = ("queue_s", "provision_s", "run_s", "export_s", "verify_s")
    for phase in (p for p in shown if p in values or p != "verify_s"):
        vs = values.get(phase, [])
        stats = (
            f" — n {len(vs)}, p50 {charts.fmt_seconds(percentile(vs, 50))}, "
            f"p95 {charts.fmt_seconds(percentile(vs, 95))}"
            if vs
            else ""
        )
        parts.append(
            f'<div class="phase"><h3>{escape(PHASE_NAMES[phase])}{stats}</h3>'
            + _phase_hist(phase, vs, PHASE_COLOURS[phase], f"hist-{phase.removesuffix('_s')}")
            + "</div>"
        )
    return "".join(parts)


def _cleanup(report: dict[str, Any], envs: list[EnvRow], events: list[Any]) -> str:
    seconds = [e.cleanup_ms / 1000 for e in envs if e.cleanup_ms is not None]
    retried = [e for e in envs if (e.destroy_attempts or 0) > 1]
    leaked = [e for e in envs if e.confirmed_absent_at is None]
    stats = (
        f"n {len(seconds)} · p50 {charts.fmt_seconds(percentile(seconds, 50))} · "
        f"p95 {charts.fmt_seconds(percentile(seconds, 95))} · "
        f"max {charts.fmt_seconds(max(seconds))} · {len(retried)} needed a retry"
        if seconds
        else "no destroy recorded"
    )
    parts = [
        "<h2>Cleanup (destroy + confirm absent)</h2>",
        f'<div class="meta">{stats}</div>',
        _phase_hist("destroy_s", seconds, PHASE_COLOURS["destroy_s"], "chart-cleanup"),
    ]
    if leaked:
        rows = "".join(
            f"<tr><td>{escape(e.env_id)}</td><td>{escape(e.episode_id or '')}</td>"
            f"<td>{escape(e.state)}</td><td class='n'>{e.destroy_attempts or 0}</td></tr>"
            for e in leaked
        )
        parts.append(
            '<h3 class="bad">Envs not confirmed absent (run <code>cleanroom reap</code>)</h3>'
            '<table id="leaks"><tr><th>env</th><th>episode</th><th>state</th>'
            f'<th class="n">destroy attempts</th></tr>{rows}</table>'
        )
    else:
        parts.append('<p class="ok" id="leaks">No orphans, no leaks.</p>')
    if events:
        items = "".join(
            f"<li>{escape(_when(ev.ts))} <b>{escape(ev.kind)}</b> "
            f"{escape(ev.env_id or ev.episode_id or '')} {escape(str(ev.data)[:160])}</li>"
            for ev in events
        )
        parts.append(f'<h3>Ledger events</h3><ul class="events">{items}</ul>')
    return "".join(parts)


def _timeline(envs: list[EnvRow], run: dict[str, Any] | None) -> str:
    if not envs:
        return "<h2>Envs over time</h2><p>No env was created in this run.</p>"
    t0 = min(e.intent_at for e in envs)
    ends = [
        t
        for e in envs
        for t in (e.confirmed_absent_at, e.destroyed_at, e.destroy_started_at, e.ready_at)
        if t is not None
    ]
    end = max([*ends, (run or {}).get("finished") or 0.0, t0 + 0.001])
    legend = _legend(
        [
            ("provision", PHASE_COLOURS["provision_s"]),
            ("run + collect + export", PHASE_COLOURS["run_s"]),
            ("destroy + confirm", PHASE_COLOURS["destroy_s"]),
            ("not confirmed absent", LEAKED),
        ]
    )
    return (
        "<h2>Envs over time</h2>"
        f'<div class="meta">one bar per env, from its ledger intent (before the VM existed) to '
        f"its confirmed absence; time since the first intent</div>{legend}"
        + charts.timeline("chart-timeline", _lanes(envs, t0, end), end - t0)
    )


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else ""


def _episodes(report: dict[str, Any]) -> str:
    def sec(row: dict[str, Any], phase: str) -> str:
        v = row["timings"].get(phase)
        return "" if v is None else charts.fmt_seconds(v)

    rows = "".join(
        f"<tr><td>{escape(r['episode_id'])}</td><td class='n'>{r['attempt']}</td>"
        f"<td style='color:{OUTCOME_COLOURS.get(r['outcome'] or '', '#777')}'>"
        f"{escape(r['outcome'] or r['state'].lower())}</td><td>{escape(r['policy'])}</td>"
        f"<td class='n'>{_num(r['reward'])}</td>"
        f"<td class='n'>{sec(r, 'provision_s')}</td><td class='n'>{sec(r, 'run_s')}</td>"
        f"<td class='n'>{sec(r, 'destroy_s')}</td>"
        f"<td>{'—' if r['confirmed_absent'] is None else 'yes' if r['confirmed_absent'] else 'NO'}"
        f"</td><td>{escape((r['error'] or '')[:80])}</td></tr>"
        for r in report["episodes"]
    )
    head = "".join(
        f"<th{' class=n' if n in ('attempt', 'reward', 'provision', 'run', 'cleanup') else ''}>"
        f"{n}</th>"
        for n in (
            "episode",
            "attempt",
            "outcome",
            "policy",
            "reward",
            "provision",
            "run",
            "cleanup",
            "absent",
            "error",
        )
    )
    return f'<h2>Episodes</h2><table id="episodes"><tr>{head}</tr>{rows}</table>'


def render_html(run_id: str, ledger: Ledger, store: Store | None = None) -> str:
    """The whole report page for ``run_id`` as one HTML string."""
    report = run_report_json(run_id, ledger, store)
    envs = ledger.envs(run_id)
    events = [e for e in ledger.events(run_id) if e.kind in NOTABLE_EVENTS]
    sections = [
        _header(report, envs),
        _outcomes(report),
        _rewards(report),
        _timeline(envs, report["run"]),
        _latencies(report),
        _cleanup(report, envs, events),
        _episodes(report),
    ]
    body = "".join(f"<section>{s}</section>" for s in sections)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>cleanroom run {escape(run_id)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{_CSS}</style></head><body><main>{body}"
        f'<p class="meta">generated by cleanroom at {escape(_when(time.time()))}</p>'
        "</main></body></html>\n"
    )


def write_html(run_id: str, ledger: Ledger, store: Store | None, path: Path) -> None:
    """Render the report and write it to ``path``."""
    if ledger.get_run(run_id) is None:
        raise ConfigError(f"no run {run_id!r} in the ledger {ledger.path}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_html(run_id, ledger, store), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {path}: {exc}") from exc

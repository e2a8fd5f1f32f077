"""The report's sections, each a function of the run report (and the ledger's rows)."""

from __future__ import annotations

from html import escape
from typing import Any

from cleanroom.ledger import EnvRow
from cleanroom.observe import charts
from cleanroom.observe.htmlreport.style import (
    OUTCOME_COLOURS,
    PHASE_COLOURS,
    PHASE_NAMES,
    POLICY_COLOURS,
    fmt_num,
    fmt_when,
)
from cleanroom.observe.report import OUTCOMES, percentile


def header(report: dict[str, Any], envs: list[EnvRow]) -> str:
    run = report["run"] or {}
    summary = report["summary"]
    leaked = [e for e in envs if e.confirmed_absent_at is None]
    accel = sorted({e.accelerator for e in envs if e.accelerator})
    wall = (run.get("finished") or 0) - (run.get("created") or 0)
    facts = [
        ("status", run.get("status", "not in the ledger")),
        ("driver", f"{run.get('driver') or '?'} ({', '.join(accel) or 'accelerator unknown'})"),
        ("baseline", run.get("baseline") or "?"),
        ("started", fmt_when(run.get("created"))),
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


def outcomes(report: dict[str, Any]) -> str:
    counts = report["summary"]["outcomes"]
    items = [(o, float(counts.get(o, 0)), OUTCOME_COLOURS.get(o, "#999")) for o in OUTCOMES]
    items += [(o, float(n), "#999") for o, n in counts.items() if o not in OUTCOMES]
    return "<h2>Outcomes</h2>" + charts.bar_chart("chart-outcomes", items)


def rewards(report: dict[str, Any]) -> str:
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


def latencies(report: dict[str, Any]) -> str:
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
        starts = report["summary"].get("starts") or {}
        if phase == "provision_s" and starts:  # spare, snapshot, fork, cold: why it took that
            stats += " — " + ", ".join(f"{n} {kind}" for kind, n in starts.items())
        parts.append(
            f'<div class="phase"><h3>{escape(PHASE_NAMES[phase])}{stats}</h3>'
            + _phase_hist(phase, vs, PHASE_COLOURS[phase], f"hist-{phase.removesuffix('_s')}")
            + "</div>"
        )
    return "".join(parts)


def cleanup(report: dict[str, Any], envs: list[EnvRow], events: list[Any]) -> str:
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
            f"<li>{escape(fmt_when(ev.ts))} <b>{escape(ev.kind)}</b> "
            f"{escape(ev.env_id or ev.episode_id or '')} {escape(str(ev.data)[:160])}</li>"
            for ev in events
        )
        parts.append(f'<h3>Ledger events</h3><ul class="events">{items}</ul>')
    return "".join(parts)


def episodes(report: dict[str, Any]) -> str:
    def sec(row: dict[str, Any], phase: str) -> str:
        v = row["timings"].get(phase)
        return "" if v is None else charts.fmt_seconds(v)

    rows = "".join(
        f"<tr><td>{escape(r['episode_id'])}</td><td class='n'>{r['attempt']}</td>"
        f"<td style='color:{OUTCOME_COLOURS.get(r['outcome'] or '', '#777')}'>"
        f"{escape(r['outcome'] or r['state'].lower())}</td><td>{escape(r['policy'])}</td>"
        f"<td class='n'>{fmt_num(r['reward'])}</td>"
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

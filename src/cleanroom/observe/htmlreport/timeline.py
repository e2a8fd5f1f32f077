"""The report's timeline: one bar per env, from its ledger intent to its confirmed absence."""

from __future__ import annotations

from typing import Any

from cleanroom.ledger import EnvRow
from cleanroom.observe import charts
from cleanroom.observe.htmlreport.style import LEAKED, PHASE_COLOURS, legend_html


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
        owner = (
            f"episode {env.episode_id} (attempt {env.attempt})"
            if env.episode_id is not None
            else "a group's warm parent (its setup, then its snapshot)"
        )
        title = (
            f"{env.env_id} · {owner} · "
            f"{env.accelerator or env.driver or ''} · {charts.fmt_seconds(life)} from intent to "
            + ("confirmed absent" if absent else "NOT confirmed absent")
            + (f" · cleanup {env.cleanup_ms:.1f} ms" if env.cleanup_ms is not None else "")
        )
        label = env.episode_id or f"warm parent {env.env_id}"
        cls = "" if absent else "leaked"
        lanes.append(charts.Lane(env.env_id, label, _span_pieces(env, t0, end), title, cls))
    return lanes


def timeline(envs: list[EnvRow], run: dict[str, Any] | None) -> str:
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
    key = legend_html(
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
        f"its confirmed absence; time since the first intent</div>{key}"
        + charts.timeline("chart-timeline", _lanes(envs, t0, end), end - t0)
    )

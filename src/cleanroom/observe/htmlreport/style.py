"""The report's look: colours, CSS and the small formatting helpers every section uses."""

from __future__ import annotations

import time
from html import escape
from typing import Any

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
NOTABLE_EVENTS = (
    "env_leaked",
    "env_unknown",
    "export_failed",
    "destroy_proof_failed",
    "run_resumed",
)

CSS = """
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


def legend_html(items: list[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><i style="background:{c}"></i>{escape(n)}</span>' for n, c in items)
        + "</div>"
    )


def fmt_when(ts: float | None) -> str:
    return "—" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else ""

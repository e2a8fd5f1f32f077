"""Imported first by the Ray benchmarks: Ray's environment, set before Ray is imported (the
cluster's processes inherit it). Telemetry off, loopback only, and Ray's own background work
(metrics, task events, event stats) off: an idle 3-node cluster takes ~1/4 less CPU
(docs/performance.md, "Ray")."""

from __future__ import annotations

import os

QUIET = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback only
    "RAY_enable_metrics_collection": "0",
    "RAY_metrics_report_interval_ms": "0",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_event_stats": "0",
}
for _key, _value in QUIET.items():
    os.environ.setdefault(_key, _value)

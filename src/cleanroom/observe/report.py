"""Run reports: what happened to every episode, as data (``run_report_json``) or as rich tables.

Reads only the ledger and the store it is given. The ledger gives outcomes, attempts, errors and
each environment's cleanup; the store's result records add policy, verdict and phase timings.
Rewards are grouped per policy ``id@version``, split by a short hash of ``params`` where one
``id@version`` ran with several (``angle@1#3f2a9c1d``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from rich.table import Table
from rich.text import Text

from cleanroom.core.states import Outcome
from cleanroom.drivers.base import start_label
from cleanroom.host.digests import digest_of
from cleanroom.ledger import EnvRow, EpisodeRow, Ledger
from cleanroom.store import Store

OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)
ERROR_WIDTH = 60
PHASES = ("queue_s", "provision_s", "run_s", "collect_s", "verify_s", "export_s", "destroy_s")
_STYLE = {"completed": "green", "episode_error": "yellow", "timeout": "yellow"}


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks.

    The rank is ``q/100 * (n - 1)`` over the sorted values (numpy's default, Excel's
    PERCENTILE.INC): p0 is the minimum, p100 the maximum, p50 the median. Raises ValueError
    for no values or q out of range.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100 or math.isnan(q):
        raise ValueError(f"percentile q must be within [0, 100], not {q}")
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _policy(record: dict[str, Any] | None) -> tuple[str, str | None]:
    """``id@version`` and a short hash of ``params`` (None without params)."""
    policy = (record or {}).get("policy")
    if not isinstance(policy, dict) or not policy.get("id"):
        return "(unknown)", None
    params = policy.get("params") or None
    short = digest_of(params).removeprefix("sha256:")[:8] if params else None
    return f"{policy['id']}@{policy.get('version', '0')}", short


def policy_labels(records: Iterable[dict[str, Any] | None]) -> dict[str, str]:
    """Episode id -> its policy's label: ``id@version``, plus ``#<params hash>`` where episodes
    of one ``id@version`` ran with different ``params`` (a sweep must not merge its settings)."""
    seen = {r.get("episode_id"): _policy(r) for r in records if r}
    hashes: dict[str, set[str | None]] = {}
    for name, short in seen.values():
        hashes.setdefault(name, set()).add(short)
    return {
        str(eid): f"{name}#{short or 'noparams'}" if len(hashes[name]) > 1 else name
        for eid, (name, short) in seen.items()
    }


def _timings(record: dict[str, Any] | None, env: EnvRow | None) -> dict[str, float]:
    """Phase durations in seconds: the record's ``*_s`` timings, plus destroy_s from the ledger."""
    raw = (record or {}).get("timings")
    phases = {
        k: float(v)
        for k, v in (raw.items() if isinstance(raw, dict) else ())
        if k.endswith("_s") and isinstance(v, int | float) and not isinstance(v, bool)
    }
    if env is not None and env.cleanup_ms is not None:
        phases["destroy_s"] = env.cleanup_ms / 1000
    return phases


def _start(record: dict[str, Any] | None) -> str | None:
    """How the episode's env started (``start_label`` of its provenance); None without one."""
    provenance = (record or {}).get("provenance")
    if not isinstance(provenance, dict) or not isinstance(provenance.get("start"), str):
        return None
    return start_label(provenance["start"], provenance.get("spare_s"))


def template_builds(ledger: Ledger, run_id: str) -> list[dict[str, Any]]:
    """The snapshot template builds this run waited for (``template_built`` events, with the
    unix ``start``/``end`` of each build)."""
    out = []
    for event in ledger.events(run_id, "template_built"):
        seconds = float(event.data.get("seconds") or 0.0)
        out.append({**event.data, "start": event.ts - seconds, "end": event.ts})
    return out


def _waited_for_template(record: dict[str, Any] | None, builds: list[dict[str, Any]]) -> bool:
    """Did this episode's provisioning overlap a template build (its provision_s includes it)?"""
    span = (((record or {}).get("timings") or {}).get("phases") or {}).get("provision")
    if not isinstance(span, dict) or not builds:
        return False
    start, end = span.get("start"), span.get("end")
    if not isinstance(start, int | float) or not isinstance(end, int | float):
        return False
    return any(start < b["end"] and end > b["start"] for b in builds)


def _episode(
    ep: EpisodeRow, env: EnvRow | None, record: dict[str, Any] | None, policy: str
) -> dict[str, Any]:
    reward = ep.reward if ep.reward is not None else (record or {}).get("reward")
    verdict = ep.verdict if ep.verdict is not None else (record or {}).get("verdict")
    wall = ep.ended_at - ep.started_at if ep.ended_at and ep.started_at else None
    return {
        "episode_id": ep.episode_id,
        "attempt": ep.attempt,
        "state": ep.state,
        "outcome": ep.outcome,
        "reward": reward,
        "verdict": verdict,
        "error": ep.error,
        "policy": policy,
        "env_id": ep.env_id,
        "cleanup_ms": env.cleanup_ms if env else None,
        "confirmed_absent": (env.confirmed_absent_at is not None) if env else None,
        "durable": record is not None,
        "start": _start(record),
        "wall_s": wall,
        "timings": _timings(record, env),
    }


def _phase_rank(phase: str) -> tuple[int, str]:
    return (PHASES.index(phase) if phase in PHASES else len(PHASES), phase)


def _summary(counts: dict[str, int], rows: list[dict[str, Any]]) -> dict[str, Any]:
    rewards: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {}
    for row in rows:
        if isinstance(row["reward"], int | float):
            rewards.setdefault(row["policy"], []).append(float(row["reward"]))
        for phase, seconds in row["timings"].items():
            phases.setdefault(phase, []).append(seconds)
    envs = [r for r in rows if r["confirmed_absent"] is not None]
    starts = Counter(row["start"] for row in rows if row["start"] is not None)
    return {
        "episodes": len(rows),
        "outcomes": {**dict.fromkeys(OUTCOMES, 0), **counts},
        "rewards": {p: {"n": len(v), "mean": sum(v) / len(v)} for p, v in rewards.items()},
        "phases": {
            p: {"n": len(v), "p50": percentile(v, 50), "p95": percentile(v, 95)}
            for p, v in sorted(phases.items(), key=lambda kv: _phase_rank(kv[0]))
        },
        "starts": dict(starts.most_common()),
        "envs": {
            "total": len(envs),
            "confirmed_absent": sum(1 for r in envs if r["confirmed_absent"]),
        },
    }


def run_report_json(run_id: str, ledger: Ledger, store: Store | None = None) -> dict[str, Any]:
    """Everything known about a run as JSON-ready data: run, summary, one entry per episode."""
    run = ledger.get_run(run_id)
    envs = {e.env_id: e for e in ledger.envs(run_id)}
    records = {r.get("episode_id"): r for r in store.list_records(run_id)} if store else {}
    labels = policy_labels(records.values())
    builds = template_builds(ledger, run_id)
    rows = [
        _episode(
            ep,
            envs.get(ep.env_id or ""),
            records.get(ep.episode_id),
            labels.get(ep.episode_id, "(unknown)"),
        )
        for ep in ledger.episodes(run_id)
    ]
    for row in rows:
        row["waited_for_template"] = _waited_for_template(records.get(row["episode_id"]), builds)
    summary = _summary(ledger.outcome_counts(run_id), rows)
    summary["template_builds"] = [
        {k: b.get(k) for k in ("baseline", "digest", "seconds")} for b in builds
    ]
    summary["waited_for_template"] = sum(1 for row in rows if row["waited_for_template"])
    return {
        "run_id": run_id,
        "run": None if run is None else asdict(run),
        "summary": summary,
        "episodes": rows,
    }


def _outcome_text(outcome: str | None, state: str) -> Text:
    if outcome is None:
        return Text(state.lower(), style="dim")
    return Text(outcome, style=_STYLE.get(outcome, "red"))


def summary_table(run_id: str, ledger: Ledger, store: Store | None = None) -> Table:
    """Counts per outcome, mean reward per policy, p50/p95 per phase, how the envs started,
    envs confirmed absent."""
    report = run_report_json(run_id, ledger, store)
    summary, run = report["summary"], report["run"]
    title = f"run {run_id}" + (f" ({run['status']})" if run else " (not in the ledger)")
    table = Table(title=title)
    table.add_column("")
    table.add_column("n", justify="right")
    table.add_column("value", justify="right")
    for outcome, n in summary["outcomes"].items():
        table.add_row(_outcome_text(outcome, "") if n else Text(outcome, style="dim"), str(n), "")
    table.add_section()
    for policy, stats in summary["rewards"].items():
        table.add_row(f"mean reward {policy}", str(stats["n"]), f"{stats['mean']:.4g}")
    table.add_section()
    for phase, stats in summary["phases"].items():
        value = f"p50 {stats['p50']:.3f}s  p95 {stats['p95']:.3f}s"
        table.add_row(phase, str(stats["n"]), value)
    if summary["starts"]:
        starts = "  ".join(f"{kind} {n}" for kind, n in summary["starts"].items())
        table.add_section()
        table.add_row("env starts", str(sum(summary["starts"].values())), starts)
    for build in summary["template_builds"]:
        table.add_row(
            f"waited for the {build['baseline']} template build (first run only)",
            str(summary["waited_for_template"]),
            f"built in {build['seconds']:.1f}s",
        )
    envs = summary["envs"]
    leaked = envs["total"] - envs["confirmed_absent"]
    table.add_section()
    table.add_row(
        "envs confirmed absent",
        f"{envs['confirmed_absent']}/{envs['total']}",
        Text("all" if not leaked else f"{leaked} NOT confirmed", style="red" if leaked else ""),
    )
    return table


def episodes_table(run_id: str, ledger: Ledger, store: Store | None = None) -> Table:
    """One row per episode (its latest attempt): outcome, reward, verdict, cleanup, error."""
    table = Table(title=f"episodes of {run_id}")
    for name in ("episode", "attempt", "outcome", "reward", "verdict", "cleanup ms", "absent"):
        table.add_column(
            name, justify="right" if name in ("attempt", "reward", "cleanup ms") else "left"
        )
    table.add_column("error", overflow="fold")
    for row in run_report_json(run_id, ledger, store)["episodes"]:
        absent = row["confirmed_absent"]
        error = row["error"] or ""
        table.add_row(
            row["episode_id"],
            str(row["attempt"]),
            _outcome_text(row["outcome"], row["state"]),
            f"{row['reward']:.4g}" if isinstance(row["reward"], int | float) else "",
            "" if row["verdict"] is None else str(row["verdict"]),
            "" if row["cleanup_ms"] is None else f"{row['cleanup_ms']:.1f}",
            Text(
                "-" if absent is None else "yes" if absent else "NO",
                "red" if absent is False else "",
            ),
            error if len(error) <= ERROR_WIDTH else error[: ERROR_WIDTH - 1] + "…",
        )
    return table

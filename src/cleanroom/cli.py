"""The ``cleanroom`` command line (typer + rich).

Exit codes of ``run``: 0 every episode reached a final outcome and every env was confirmed
absent; 1 some episode ended in infra_error / env_crashed / export_failed, or in an outcome
named by ``--fail-on`` (e.g. ``episode_error,timeout``); 2 bad input (manifest, baseline,
drift, config); 3 an env was still present after the cleanup window; 130 cancelled (Ctrl-C or
SIGTERM).

Observing a run: ``--metrics-port`` serves Prometheus metrics on 127.0.0.1 while it lasts,
``--metrics-textfile`` writes them for node_exporter's textfile collector; structured logs go to
stderr (human on a terminal, JSON otherwise) and, with ``--log-file``, to a JSON Lines file;
``cleanroom report RUN_ID --html FILE`` draws the run as one self-contained page.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from cleanroom.baseline.cli import baseline_app
from cleanroom.batch.result import RunResult
from cleanroom.batch.runner import EventHook, RunOptions
from cleanroom.checks.check_cli import check_app
from cleanroom.checks.evidence_cli import audit_app, export_public, replay_command
from cleanroom.errors import CleanroomError, ConfigError
from cleanroom.host import paths, private
from cleanroom.ledger import Ledger
from cleanroom.observe import logs
from cleanroom.observe.progress import RunProgress
from cleanroom.server.cli import keys_app
from cleanroom.server.cli import serve as serve_command
from cleanroom.store import open_store

app = typer.Typer(
    help="A fresh, disposable microVM per RL episode: pinned baselines, durable evidence, "
    "proven destruction.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    callback=private.check_home_or_exit,  # the home is private (0700, ours), umask 077
)
app.add_typer(baseline_app, name="baseline")
app.add_typer(check_app, name="check")
keys_app.command("export-public")(export_public)  # the signing key beside the server's API keys
app.add_typer(keys_app, name="keys")
app.add_typer(audit_app, name="audit")
app.command("replay")(replay_command)
app.command("serve")(serve_command)
err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 140)  # tables stay readable in logs


def _fail(exc: CleanroomError) -> typer.Exit:
    err.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
    return typer.Exit(2)


@app.command()
def run(
    manifests: Annotated[Path, typer.Argument(help="JSON Lines file, one manifest per line")],
    baseline: Annotated[
        str,
        typer.Option(help="baseline digest, unique prefix, name, or spec (.toml or its folder)"),
    ],
    parallel: Annotated[int, typer.Option(min=1, max=256, help="episodes at once")] = 2,
    spares: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=256,
            help="envs kept started ahead (qemu; default: --parallel, at most the idle cores)",
        ),
    ] = None,
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
    run_id: Annotated[str | None, typer.Option(help="resume (or name) this run")] = None,
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake | auto")] = "qemu",
    cleanup_window: Annotated[float, typer.Option(help="seconds to confirm an env gone")] = 30.0,
    secrets_from: Annotated[
        str, typer.Option(help="secret values from: env | env:PREFIX | file:PATH | cmd:PROGRAM")
    ] = "env",
    metrics_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="serve Prometheus /metrics on 127.0.0.1:PORT"),
    ] = None,
    metrics_textfile: Annotated[
        Path | None, typer.Option(help="write metrics here (textfile-collector format)")
    ] = None,
    log_format: Annotated[
        str, typer.Option(help="stderr logs: auto (console on a TTY, else json) | console | json")
    ] = "auto",
    log_file: Annotated[Path | None, typer.Option(help="also write JSON Lines logs here")] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
    fail_on: Annotated[
        str | None,
        typer.Option(
            help="also exit 1 if any episode ends so, e.g. episode_error,timeout "
            "(default: only infra_error, env_crashed, export_failed, cancelled)"
        ),
    ] = None,
    ray: Annotated[
        str | None, typer.Option(help="run across a Ray cluster: auto | ADDRESS (cleanroom[ray])")
    ] = None,
    parallel_per_node: Annotated[
        int | None, typer.Option(min=1, max=256, help="with --ray: episodes at once per node")
    ] = None,
    allow_baseline_change: Annotated[
        bool,
        typer.Option(help="resume --run-id with another baseline than the run's (recorded)"),
    ] = False,
) -> None:
    """Run every manifest in a fresh environment; print a summary."""
    from cleanroom.api import arun
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.evidence.manifest import load_manifests
    from cleanroom.observe.failures import parse_fail_on

    try:
        failing = parse_fail_on(fail_on)
        logs.setup(log_format, file=log_file, level=log_level)
        if parallel_per_node is not None and ray is None:
            raise ConfigError("--parallel-per-node is for a cluster run: give --ray too")
        items = load_manifests(manifests)
        progress = RunProgress(err, lines=False)  # the logs carry one line per step
        resolved = resolve_or_build(baseline, progress=progress.build_step)
        observer = _Observer(metrics_port, metrics_textfile)
    except CleanroomError as exc:
        logs.close()
        raise _fail(exc) from exc
    options = RunOptions(
        parallel=parallel,
        cleanup_window_s=cleanup_window,
        spares=spares,
        allow_baseline_change=allow_baseline_change,
    )

    async def main() -> RunResult:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        cluster = None
        if ray is not None:  # scale out: the same manifests and records, on every node
            from cleanroom.integrations.ray import RayCluster

            cluster = RayCluster(address=ray, parallel_per_node=parallel_per_node)
        with progress:
            return await arun(  # one path: arun runs here or, with a cluster, on its nodes
                items,
                baseline=resolved if cluster is None else baseline,  # (a spec: nodes build it)
                cluster=cluster,
                store=store,
                run_id=run_id,
                driver=driver,
                options=options,
                on_event=observer.hook(progress.on_event),
                secrets_from=secrets_from,
            )

    try:
        result = asyncio.run(main())
    except KeyboardInterrupt:
        err.print("[yellow]cancelled[/]: every running env was destroyed; see `cleanroom status`")
        raise typer.Exit(130) from None
    except asyncio.CancelledError:
        err.print("[yellow]cancelled[/] (SIGTERM): every running env was destroyed")
        raise typer.Exit(130) from None
    except CleanroomError as exc:
        raise _fail(exc) from exc
    finally:
        observer.close()
        logs.close()
    counts = _print_run(result.run_id, store, failures=True)
    _print_groups(result)
    if result.leaked_envs:
        err.print(
            f"[bold red]ALERT[/]: envs still present for {result.leaked_envs}; run `cleanroom reap`"
        )
        raise typer.Exit(3)
    if any(not e.outcome.final for e in result.episodes) or failing & set(counts):
        raise typer.Exit(1)


def _print_groups(result: RunResult) -> None:
    """One line per group: how its setup ran, its episodes' outcomes, and its snapshot's fate."""
    for g in result.groups:
        setup = g.timings.get("setup_s")
        how = (
            f"setup once ({setup or 0:.1f} s), {len(g.episodes)} forked episodes"
            if g.mode == "fork"
            else f"setup in each of its {len(g.episodes)} episodes (driver cannot fork)"
        )
        members = set(g.episodes)
        counts: dict[str, int] = {}
        for episode in result.episodes:
            if episode.episode_id in members:
                counts[episode.outcome.value] = counts.get(episode.outcome.value, 0) + 1
        how += " · " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        if g.classification:
            how += f" · [bold red]{g.classification}[/]: {(g.error or '').splitlines()[0][:120]}"
        if g.snapshot_deleted is not None:
            how += " · snapshot deleted" if g.snapshot_deleted else " · [bold red]snapshot LEFT[/]"
        out.print(f"group {g.group_id}: {how}", soft_wrap=True)


class _Observer:
    """The run's observers besides progress: logs always, metrics when asked for."""

    def __init__(self, port: int | None, textfile: Path | None) -> None:
        from cleanroom.observe.metrics import MetricsServer, RunMetrics, TextfileWriter

        self.events = logs.EventLogger()
        self.metrics = RunMetrics() if port is not None or textfile is not None else None
        self.server: MetricsServer | None = None
        self.writer: TextfileWriter | None = None
        try:
            if self.metrics is not None and port is not None:
                self.server = self.metrics.serve(port)
                err.print(f"metrics: http://127.0.0.1:{self.server.port}/metrics", highlight=False)
            if self.metrics is not None and textfile is not None:
                self.writer = TextfileWriter(self.metrics, textfile).start()
        except BaseException:
            self.close()
            raise

    def hook(self, *more: EventHook) -> EventHook:
        from cleanroom.observe.metrics import compose

        metrics = self.metrics.on_event if self.metrics is not None else None
        return compose(*more, self.events.on_event, metrics)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.server is not None:
            self.server.close()


def _print_run(run_id: str, store: str | None, *, failures: bool = False) -> dict[str, int]:
    """The episodes and summary tables (and, with ``failures``, why each failed episode did);
    returns the run's outcome counts."""
    from cleanroom.observe import failures as why
    from cleanroom.observe.report import episodes_table, summary_table

    with Ledger() as ledger:
        st = open_store(store)
        out.print(episodes_table(run_id, ledger, st))
        out.print(summary_table(run_id, ledger, st))
        counts = ledger.outcome_counts(run_id)
        failed = why.failures(run_id, ledger, st) if failures else []
    lines = why.report_lines(run_id, failed, sum(counts.values()), st.run_uri(run_id))
    for line in lines:
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(f"run id: [bold]{run_id}[/]   store: {st.run_uri(run_id)}")
    return counts


def _require_run(ledger: Ledger, run_id: str) -> None:
    """Exit 2 with a clear message unless the ledger knows ``run_id``."""
    if ledger.get_run(run_id) is None:
        err.print(f"[red]error:[/] no run {run_id!r} in {paths.ledger_path()}")
        raise typer.Exit(2)


@app.command()
def status(
    run_id: Annotated[str, typer.Argument(help="the run to show")],
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """Counts per outcome, one row per episode of a run, and why each failed one failed."""
    with Ledger() as ledger:
        _require_run(ledger, run_id)
    _print_run(run_id, store, failures=True)


@app.command()
def report(
    run_id: Annotated[str, typer.Argument(help="the run to report on")],
    html: Annotated[Path | None, typer.Option(help="write a self-contained HTML report")] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="write the report as JSON")
    ] = None,
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """A run's report: tables on the terminal, or --html / --json files."""
    from cleanroom.observe.htmlreport import write_html
    from cleanroom.observe.report import run_report_json

    with Ledger() as ledger:
        _require_run(ledger, run_id)
        st = open_store(store)
        try:
            if html is not None:
                write_html(run_id, ledger, st, html)
                out.print(f"html report: {html}")
            if json_out is not None:
                data = json.dumps(run_report_json(run_id, ledger, st), indent=1, default=str)
                json_out.parent.mkdir(parents=True, exist_ok=True)
                json_out.write_text(data + "\n", encoding="utf-8")
                out.print(f"json report: {json_out}")
        except OSError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from exc
        except CleanroomError as exc:
            raise _fail(exc) from exc
    if html is None and json_out is None:
        _print_run(run_id, store)


@app.command()
def runs() -> None:
    """List runs, newest first."""
    from rich.table import Table

    table = Table("run id", "status", "driver", "baseline", "episodes")
    with Ledger() as ledger:
        for r in ledger.list_runs():
            counts = ledger.outcome_counts(r.run_id)
            table.add_row(
                r.run_id,
                r.status or "",
                r.driver or "",
                (r.baseline or "")[:19],
                ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            )
    out.print(table)


@app.command()
def ps(
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake")] = "qemu",
    ray: Annotated[
        str | None,
        typer.Option(help="every node of a Ray cluster: auto | ADDRESS (cleanroom[ray])"),
    ] = None,
) -> None:
    """Live environments: what the ledger says, and what the host really has."""
    from rich.table import Table

    from cleanroom.drivers import get_driver
    from cleanroom.observe.live_envs import LiveEnv, live_envs

    table = Table(*(["node"] if ray else []), "env id", "age", "episode", "run", "owner pid")
    table.add_column("on host")

    def add(e: LiveEnv) -> None:
        cells = [
            e.env_id,
            f"{e.age_s:.0f}s" if e.age_s is not None else "?",
            e.episode,
            e.run,
            str(e.owner_pid or ""),
            "yes" if e.on_host else "no",
        ]
        table.add_row(*([e.node[:12]] if ray else []), *cells)

    if ray is None:
        for e in live_envs(get_driver(driver)):
            add(e)
        out.print(table)
        _print_live_snapshots()
        return
    from cleanroom.integrations.ray import RayCluster
    from cleanroom.integrations.ray.ps import cluster_envs

    try:
        answers = cluster_envs(RayCluster(address=ray), driver)
    except CleanroomError as exc:
        raise _fail(exc) from exc
    for node in answers:
        for e in node.envs:
            add(e)
        if node.error:
            table.add_row(node.node[:12], "", "", f"(no answer: {node.error})", "", "", "")
    out.print(table)
    err.print(f"{len(answers)} nodes, {sum(len(n.envs) for n in answers)} live envs")


def _print_live_snapshots() -> None:
    """Group snapshots not yet confirmed deleted (only shown when there are some)."""
    import time

    from rich.table import Table

    from cleanroom.drivers.qemu.fork import folder

    with Ledger() as ledger:
        rows = ledger.snapshots(live_only=True)
    if not rows:
        return
    table = Table("snapshot id", "age", "group", "run", "state", "owner pid", "files on host")
    for row in rows:
        table.add_row(
            row.snapshot_id,
            f"{time.time() - row.intent_at:.0f}s",
            row.group_id or "",
            row.run_id or "",
            row.state,
            str(row.owner_pid or ""),
            "yes" if folder(row.snapshot_id).exists() else "no",
        )
    out.print(table)


@app.command()
def reap(
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake")] = "qemu",
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """Destroy every env (and group snapshot) whose controller is gone; mark its unfinished
    episode infra_error."""
    from cleanroom.drivers import get_driver
    from cleanroom.lifecycle.reaper import reap as reap_orphans

    with Ledger() as ledger:
        report = asyncio.run(reap_orphans(get_driver(driver), ledger, open_store(store)))
    for env_id in report.destroyed:
        out.print(f"reaped {env_id} (confirmed absent)")
    for run_id, eid, attempt in report.episodes_marked:
        out.print(f"marked {run_id}/{eid} attempt {attempt} infra_error (controller lost)")
    for snapshot_id in report.snapshots:
        out.print(f"deleted snapshot {snapshot_id} (confirmed absent)")
    if report.failed:
        err.print(f"[bold red]ALERT[/]: still present after destroy: {', '.join(report.failed)}")
        raise typer.Exit(3)
    if not report.destroyed and not report.snapshots:
        out.print("nothing to reap")


def _utf8_safe(value: Any) -> bool:
    """Whether ``value``'s JSON text can be written as UTF-8 (no lone surrogate in it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@app.command()
def inspect(
    episode_id: Annotated[str, typer.Argument(help="episode id")],
    run_id: Annotated[str | None, typer.Option(help="the run (default: latest with it)")] = None,
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """Print an episode's durable result record (with its provenance). With none (an attempt
    that ended infra_error, say a guest that did not boot), what its attempts kept, and exit 2."""
    from cleanroom.observe.failures import attempts_kept

    st = open_store(store)
    with Ledger() as ledger:
        candidates = [run_id] if run_id else [r.run_id for r in ledger.list_runs()]
        for rid in candidates:
            try:
                record: dict[str, Any] | None = st.get_record(rid, episode_id)
            except CleanroomError as exc:  # an unreadable record: say so, no traceback
                raise _fail(exc) from exc
            if record is not None:
                # a string with no UTF-8 form (a lone surrogate, from a record an older version
                # wrote) is printed as its JSON escape rather than crashing the terminal's encoder
                out.print_json(json.dumps(record), ensure_ascii=not _utf8_safe(record))
                return
        for rid in candidates:
            kept = attempts_kept(st, ledger, rid, episode_id)
            if kept:
                shown = {"run_id": rid, "episode_id": episode_id, "record": None}
                out.print_json(json.dumps({**shown, "attempts": kept}))
                err.print(
                    f"[red]error:[/] no durable record for {episode_id!r} in run {rid!r};"
                    f" what its {len(kept)} attempt(s) kept is above"
                )
                raise typer.Exit(2)
    err.print(f"[red]error:[/] no durable record for {episode_id!r}")
    raise typer.Exit(2)


@app.command()
def shell(
    baseline: Annotated[
        str,
        typer.Option(help="baseline digest, unique prefix, name, or spec (.toml or its folder)"),
    ],
    user: Annotated[str | None, typer.Option(help="run the shell as this guest user")] = None,
    timeout: Annotated[
        float, typer.Option(help="seconds the shell may live (then it ends as timeout)")
    ] = 3600.0,
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake")] = "qemu",
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """A terminal in a fresh env: a PTY (raw mode, window size, Ctrl-C to the guest), recorded
    as a session; on exit the env is destroyed and confirmed absent."""
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.drivers import get_driver
    from cleanroom.sessions.shell import shell as run_shell

    def note(line: str) -> None:
        err.print(line, highlight=False, markup=False)

    async def main() -> tuple[int, str]:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, task.cancel)
        with Ledger() as ledger:
            return await run_shell(
                resolve_or_build(baseline, progress=lambda step, detail: note(f"{step} {detail}")),
                driver=get_driver(driver),
                ledger=ledger,
                store=open_store(store),
                user=user,
                timeout_s=timeout,
                progress=note,
            )

    try:
        code, run_id = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        err.print("[yellow]cancelled[/]: the env was destroyed; see `cleanroom runs`")
        raise typer.Exit(130) from None
    except CleanroomError as exc:
        raise _fail(exc) from exc
    note(f"shell exited {code}; session {run_id} recorded, its env destroyed and confirmed absent")
    raise typer.Exit(code)


@app.command()
def doctor(
    once: Annotated[
        bool, typer.Option(help="say nothing if this host passed before (make demo uses it)")
    ] = False,
) -> None:
    """What this host has and lacks (QEMU, KVM or TCG, runsc, cgroups, build tools, disk,
    the home's modes), each gap with the command that fixes it; exit 1 if something is missing."""
    from cleanroom.checks.doctor import diagnose

    stamp = paths.home() / "doctor-passed"
    if once and stamp.exists():
        return
    findings = diagnose()
    style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    for f in findings:
        out.print(f"[{style[f.status]}]{f.status:<4}[/] {f.part:<8} ", end="", highlight=False)
        out.print(f.detail, markup=False, highlight=False)
        if f.fix and f.status != "ok":
            out.print(f"              fix: {f.fix}", markup=False, highlight=False)
    failed = [f.part for f in findings if f.status == "fail"]
    if failed:
        err.print(f"[bold red]doctor:[/] missing {', '.join(failed)}: fix the lines above")
        raise typer.Exit(1)
    if once:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text("passed\n")


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except CleanroomError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)

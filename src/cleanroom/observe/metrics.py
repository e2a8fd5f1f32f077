"""Prometheus metrics of a run, fed by the controller's events.

``RunMetrics`` owns its own ``CollectorRegistry`` (nothing lands in the process-global one) and
is an event hook: pass ``metrics.on_event`` (alone or through ``compose``) as the controller's
``on_event``. Names carry base units (seconds, totals); labels are low-cardinality only
(``outcome``, ``kind``), never an episode or env id.

    cleanroom_episodes_total{outcome}          counter    episodes ended, by outcome
    cleanroom_episode_queue_seconds            histogram  queued -> a slot was free
    cleanroom_env_provision_seconds            histogram  create -> agent ready
    cleanroom_episode_run_seconds              histogram  manifest sent -> output collected
    cleanroom_episode_export_seconds           histogram  evidence written to the store
    cleanroom_episode_verify_seconds           histogram  the verifier's run (episodes with one)
    cleanroom_env_destroy_seconds              histogram  destroy + confirm absent
    cleanroom_envs_alive                       gauge      envs not (yet) confirmed absent
    cleanroom_envs_orphaned                    gauge      envs still present after cleanup/reap
    cleanroom_export_failures_total            counter    episodes that ended export_failed
    cleanroom_env_delete_retries_total         counter    destroy attempts beyond the first
    cleanroom_baseline_drift_refusals_total    counter    a drifted baseline refused
    cleanroom_env_starts_total{kind}           counter    envs started (cold, snapshot, spare, fork)

prometheus_client is imported lazily (the ``metrics`` extra), so importing cleanroom never needs it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cleanroom.errors import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry

EventHook = Callable[[str, dict[str, Any]], None]

#: Histogram buckets in seconds: 1 ms ... 120 s, roughly 1-2.5-5 per decade.
BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
#: Record timing key -> histogram attribute.
PHASE_HISTOGRAMS = {
    "queue_s": "queue",
    "provision_s": "provision",
    "run_s": "run",
    "export_s": "export",
    "verify_s": "verify",
}


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "metrics need prometheus_client: pip install 'cleanroom[metrics]'"
        ) from exc
    return prometheus_client


def compose(*hooks: EventHook | None) -> EventHook:
    """One event hook that calls each given hook in order (``None``s are skipped)."""
    chain = [h for h in hooks if h is not None]

    def hook(kind: str, data: dict[str, Any]) -> None:
        for h in chain:
            h(kind, data)

    return hook


class RunMetrics:
    """The metrics of one controller process, updated from controller events."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        prom = _prometheus()
        self.registry: CollectorRegistry = registry or prom.CollectorRegistry()
        reg = self.registry
        self.episodes = prom.Counter(
            "cleanroom_episodes", "Episodes ended, by outcome.", ["outcome"], registry=reg
        )

        def histogram(name: str, doc: str) -> Any:
            return prom.Histogram(name, doc, buckets=BUCKETS, registry=reg)

        self.queue = histogram("cleanroom_episode_queue_seconds", "Time queued for a slot.")
        self.provision = histogram(
            "cleanroom_env_provision_seconds", "Env create until its agent is ready."
        )
        self.run = histogram("cleanroom_episode_run_seconds", "Episode run in its env.")
        self.export = histogram(
            "cleanroom_episode_export_seconds", "Evidence collected and written to the store."
        )
        self.verify = histogram(
            "cleanroom_episode_verify_seconds", "Verifier run on the episode's evidence."
        )
        self.destroy = histogram(
            "cleanroom_env_destroy_seconds", "Env destroy until confirmed absent."
        )
        self.alive = prom.Gauge(
            "cleanroom_envs_alive", "Envs not (yet) confirmed absent.", registry=reg
        )
        self.orphaned = prom.Gauge(
            "cleanroom_envs_orphaned",
            "Envs still present after their cleanup window or a reap.",
            registry=reg,
        )
        self.export_failures = prom.Counter(
            "cleanroom_export_failures", "Episodes whose evidence export failed.", registry=reg
        )
        self.delete_retries = prom.Counter(
            "cleanroom_env_delete_retries", "Destroy attempts beyond the first.", registry=reg
        )
        self.drift_refusals = prom.Counter(
            "cleanroom_baseline_drift_refusals",
            "Baselines refused because their files drifted from the digest.",
            registry=reg,
        )
        self.starts = prom.Counter(
            "cleanroom_env_starts", "Envs started, by kind.", ["kind"], registry=reg
        )
        self._lock = threading.Lock()
        self._reap_orphans = 0
        self._leaked: set[str] = set()

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        """The controller event hook."""
        with self._lock:
            handler = getattr(self, "_on_" + kind, None)
            if handler is not None:
                handler(data)

    def _on_episode_started(self, data: dict[str, Any]) -> None:
        self.alive.inc()

    def _on_env_ready(self, data: dict[str, Any]) -> None:
        self.starts.labels(kind=str(data.get("start") or "cold")).inc()

    def _on_episode_finished(self, data: dict[str, Any]) -> None:
        outcome = str(data["outcome"])
        self.episodes.labels(outcome=outcome).inc()
        if outcome == "export_failed":
            self.export_failures.inc()
        timings = data.get("timings") or {}
        for key, attr in PHASE_HISTOGRAMS.items():
            value = timings.get(key)
            if isinstance(value, int | float):
                getattr(self, attr).observe(float(value))
        if data.get("cleanup_ms") is not None:
            self.destroy.observe(float(data["cleanup_ms"]) / 1000)
        attempts = data.get("destroy_attempts")
        if isinstance(attempts, int) and attempts > 1:
            self.delete_retries.inc(attempts - 1)
        if data.get("confirmed_absent") is False:
            self._leaked.add(str(data.get("env_id")))
            self._update_orphans()
        else:
            self.alive.dec()

    def _on_alert(self, data: dict[str, Any]) -> None:
        if data.get("env_id"):
            self._leaked.add(str(data["env_id"]))
            self._update_orphans()

    def _on_reaped(self, data: dict[str, Any]) -> None:
        self._reap_orphans = len(data.get("failed") or ())
        self._update_orphans()

    def _on_drift_refused(self, data: dict[str, Any]) -> None:
        self.drift_refusals.inc()

    def _update_orphans(self) -> None:
        self.orphaned.set(self._reap_orphans + len(self._leaked))

    # -- exposition ----------------------------------------------------------------------------

    def text(self) -> str:
        """The Prometheus text exposition format of every metric."""
        return str(_prometheus().generate_latest(self.registry).decode())

    def write_textfile(self, path: Path) -> None:
        """Write the node_exporter textfile-collector format, atomically."""
        _prometheus().write_to_textfile(str(path), self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` over HTTP on ``addr:port`` (port 0: any free port) until closed."""
        try:
            server, thread = _prometheus().start_http_server(
                port, addr=addr, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
        return MetricsServer(server, thread)


class MetricsServer:
    """A running metrics HTTP server; ``close()`` stops it (idempotent)."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server: WSGIServer | None = server
        self._thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)


class TextfileWriter:
    """Writes the metrics to a textfile every ``interval_s`` and once more on ``close()``."""

    def __init__(self, metrics: RunMetrics, path: Path, interval_s: float = 15.0) -> None:
        self.metrics = metrics
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TextfileWriter:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.metrics.write_textfile(self.path)
        except OSError as exc:
            raise ConfigError(f"cannot write metrics to {self.path}: {exc}") from exc
        self._thread = threading.Thread(target=self._loop, name="metrics-textfile", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):  # e.g. disk full: the final write reports it
                self.metrics.write_textfile(self.path)

    def close(self) -> None:
        """Stop the periodic writes and write the final values (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        try:
            self.metrics.write_textfile(self.path)
        except OSError as exc:
            raise ConfigError(f"cannot write metrics to {self.path}: {exc}") from exc

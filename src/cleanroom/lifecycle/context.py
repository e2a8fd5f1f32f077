"""What a run gives each of its episodes and envs: ``RunContext`` (and the ``RunOptions``)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import Driver, Env, EnvRequest, Owner
from cleanroom.evidence.secrets import EnvSecrets, SecretProvider
from cleanroom.host import paths
from cleanroom.ledger import Ledger
from cleanroom.store import Store

Emit = Callable[..., None]  # emit(kind, **data): the run's event hook
CreateEnv = Callable[[EnvRequest], Awaitable[Env]]


@dataclass(frozen=True)
class RunOptions:
    parallel: int = 2
    cleanup_window_s: float = 30.0
    boot_timeout_s: float = 120.0
    collect_grace_s: float = 30.0
    staging_dir: Path | None = None  # host scratch for evidence in flight (default: home/staging)
    egress_hosts: Mapping[str, str] | None = None  # name -> address for egress proxies (tests)
    spares: int | None = None  # envs kept started ahead per shape (None: ``spare_count``)
    allow_baseline_change: bool = False  # resume a run with a baseline other than its own
    signing_key: Path | None = None  # signs attestations (None: $CLEANROOM_SIGNING_KEY, home's)

    def spare_count(self, cores: int | None = None) -> int:
        """Envs to keep started ahead per shape: ``spares`` where given, else one per episode
        slot that a core the episodes leave idle can start (``parallel``, at most ``cores`` -
        ``parallel``; ``cores``: this process's CPUs). A spare runs its QEMU start and a
        warm-up before its episode; on cores the episodes already fill that CPU is spent all
        the same, only earlier, and the warm-up on top: on 2 busy cores under TCG a function
        episode's spare spends ~240-250 ms of QEMU CPU against a fresh clone's ~200-215, and a
        batch with spares runs ~12% fewer episodes a second (``bench/results/spares.txt``)."""
        if self.spares is not None:
            return self.spares
        cores = len(os.sched_getaffinity(0)) if cores is None else cores
        return max(0, min(self.parallel, cores - self.parallel))


def _silent(kind: str, **data: Any) -> None:
    """The event hook of a context nobody listens to."""


@dataclass(frozen=True)
class RunContext:
    """The parts an episode, an env lease or a verifier may use; never the controller itself.

    ``store`` is None for envs whose proof has no episode folder (the isolation check)."""

    driver: Driver
    ledger: Ledger
    store: Store | None
    owner: Owner
    options: RunOptions = field(default_factory=RunOptions)
    emit: Emit = _silent
    secret_provider: SecretProvider = field(default_factory=EnvSecrets)

    def staging_root(self) -> Path:
        return self.options.staging_dir or paths.home() / "staging"

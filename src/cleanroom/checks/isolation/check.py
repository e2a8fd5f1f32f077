"""The isolation check's driver side: envs for A and B, the canary script run in them, and
the ``sequential`` and ``concurrent`` variants (``recovery.py`` has the third). See the package
docstring for what is checked and how cells are read."""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Callable

from cleanroom.checks.isolation.audit import audit
from cleanroom.checks.isolation.cells import (
    CLEANUP,
    ERROR,
    ROWS,
    VARIANTS,
    Cell,
    IsolationReport,
    Variant,
    cleanup_cell,
    evaluate,
)
from cleanroom.checks.isolation.plant import new_token, run_canary
from cleanroom.checks.isolation.recovery import recovery
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import Limits
from cleanroom.drivers import get_driver
from cleanroom.drivers.base import Driver, Env, EnvRequest, Owner, new_env_id
from cleanroom.errors import CheckError, CleanroomError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunContext
from cleanroom.lifecycle.lease import EnvLease

DriverFactory = Callable[[], Driver]


class IsolationCheck:
    """One run of the three variants against a driver and a baseline."""

    def __init__(
        self,
        driver: Driver,
        baseline: Baseline,
        ledger: Ledger,
        *,
        driver_factory: DriverFactory | None = None,
        variants: tuple[str, ...] = VARIANTS,
    ) -> None:
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise CheckError(f"unknown variant(s) {sorted(unknown)}; choose from {VARIANTS}")
        self.driver = driver
        self.baseline = baseline
        self.ledger = ledger
        self.factory = driver_factory or functools.partial(get_driver, driver.name)
        self.variants = variants
        self.check_id = time.strftime("check-isolation-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        self.owner = Owner(self.check_id)
        self.ctx = RunContext(driver, ledger, None, self.owner)  # no store: no proof files
        self.leases: dict[str, EnvLease] = {}
        self.env_ids: list[str] = []
        self.tokens: list[str] = []

    async def run(self) -> IsolationReport:
        started = time.monotonic()
        self.ledger.start_run(
            self.check_id,
            controller_id=self.check_id,
            baseline=self.baseline.digest,
            driver=self.driver.name,
            parallel=2,
            meta={"kind": "check-isolation", "variants": list(self.variants)},
        )
        results: list[Variant] = []
        status = "failed"
        try:
            for name in self.variants:
                results.append(await self._variant(name))
            leftovers = await audit(self.driver, self.env_ids, self.tokens)
            status = "completed"
        finally:
            self.ledger.finish_run(self.check_id, status)
        facts = dict(self.driver.describe())  # after the first env: accelerator known
        return IsolationReport(
            self.check_id,
            facts,
            self.baseline.digest,
            results,
            leftovers,
            time.monotonic() - started,
        )

    async def _variant(self, name: str) -> Variant:
        variant = Variant(name, new_token())
        self.tokens.append(variant.token)
        began = time.monotonic()
        runner = {"sequential": self._sequential, "concurrent": self._concurrent}
        try:
            if name == "recovery":
                await recovery(self, variant)
            else:
                await runner[name](variant)
        except (CleanroomError, OSError, TimeoutError) as exc:
            variant.error = f"{type(exc).__name__}: {exc}"
            for row in ROWS:
                variant.cells.setdefault(row, Cell(ERROR, variant.error))
        variant.seconds = round(time.monotonic() - began, 3)
        return variant

    async def _sequential(self, v: Variant) -> None:
        a = await self.create(v, "A")
        try:
            planted = await run_canary(self.driver, a, "plant", v.token)
            own = await run_canary(self.driver, a, "probe", v.token)
        finally:
            gone_a = await self.destroy(a)
        b = await self.create(v, "B")
        try:
            probe = await run_canary(self.driver, b, "probe", v.token)
        finally:
            gone_b = await self.destroy(b)
        v.cells = evaluate(planted, own, probe)
        v.cells[CLEANUP] = cleanup_cell(gone_a and gone_b, "each destroyed before the next")

    async def _concurrent(self, v: Variant) -> None:
        created = await asyncio.gather(
            self.create(v, "A"), self.create(v, "B"), return_exceptions=True
        )
        envs = [e for e in created if isinstance(e, Env)]
        try:
            for failure in created:
                if isinstance(failure, BaseException):
                    raise failure
            a, b = envs
            planted = await run_canary(self.driver, a, "plant", v.token)
            probe = await run_canary(self.driver, b, "probe", v.token)
            own = await run_canary(self.driver, a, "probe", v.token)  # A was live all along
        finally:
            gone = await asyncio.gather(*(self.destroy(e) for e in envs))
        v.cells = evaluate(planted, own, probe)
        v.cells[CLEANUP] = cleanup_cell(all(gone), "B probed while A and its process were live")

    async def create(self, v: Variant, role: str) -> Env:
        """A fresh env for ``role`` of variant ``v``: ledger intent first (``EnvLease``)."""
        env_id = new_env_id()
        self.env_ids.append(env_id)
        v.envs[role] = env_id
        label = f"{v.name}-{role}"
        lease = self.leases[env_id] = EnvLease(
            self.ctx, env_id, run_id=self.check_id, episode_id=label, attempt=1
        )
        limits = Limits().merged_over(self.baseline.limits)
        request = EnvRequest(
            env_id,
            self.baseline,
            limits,
            self.owner,
            hard_deadline_s=900,
            labels={"run_id": self.check_id, "episode_id": label, "role": "isolation-check"},
        )
        try:
            return await lease.start(request)
        except BaseException:
            await lease.close()
            raise

    async def destroy(self, env: Env) -> bool:
        """Destroy ``env`` and confirm it absent (shielded, retried in the cleanup window)."""
        return (await self.leases[env.env_id].close()).confirmed_absent

"""A seeded soak: a long random mix of episodes with random faults; then nothing may be lost.

    python bench/soak.py --seed 7 --episodes 10000 --driver fake [--out bench/results/soak.txt]

Rounds are drawn from the seed until ``--episodes`` episodes have run, each one of:

- ``batch``: a batch run in this process (``cleanroom.arun``) of guests that behave (``ok``) or
  misbehave (exit non-zero, no result, kill their agent, write junk into the agent's port, run
  past their timeout);
- ``session``: an interactive session in this process: commands, a file round trip, then
  ``finish`` or an exception in the caller's code, or the guest killing its agent mid-session;
- ``env-kill``: a batch whose env processes are SIGKILLed from outside at a random moment;
- ``controller-kill``: ``cleanroom run`` in a subprocess, SIGKILLed at a random moment, then the
  same command again (the resume);
- ``store-full``: a batch whose store is a tmpfs too small for its artifacts (ENOSPC), then
  resumed on a store with room (root only);
- ``served``: sandboxes from the e2b SDK through a ``cleanroom serve`` subprocess (the fake
  driver), the server SIGKILLed at a random moment and started again, or stopped by SIGTERM;
  every sandbox it made (creates in flight at the SIGKILL too, found in the ledger) ends with an
  outcome and its env confirmed absent, and each its client killed ``completed`` with its
  durable record;
- ``ledger-full``: ``cleanroom run`` in a subprocess whose home's ledger lies on a tmpfs of its
  own (root only), filled up at a random moment mid-run: the controller must stop starting
  episodes and exit with a ``LedgerError`` naming the ledger (no traceback), lose nothing
  durable and leave no env; once the space is freed, the run is resumed and checked;
- ``store-s3``: a batch on an S3-compatible store (moto on loopback, behind a proxy) answering
  a share of its requests with 500 / 503 or stalling them past the client's timeout (before or
  after the write happened), then resumed with the store healthy;
- ``ray-node`` (the fake driver): a batch across a local Ray cluster whose node added for the
  round is SIGKILLed mid-run; its episodes run again on the standing node, its home is reaped
  from the host alone.

After every round, from the ledger, the store and the host alone: each episode's latest attempt
has a final outcome with exactly one durable record that agrees with the ledger (outcome,
attempt), every env of the run is confirmed destroyed, nothing of the run is left in staging.
A round whose episodes are not all final is resumed (at most ``RESUMES`` times). At the end: no
env process of the driver left, and this process's memory and open descriptors flat (sampled
after each round once every kind of round has run once; the mean of the last 10% within 10% of
the first 10%'s). Memory is RSS once glibc's ``malloc_trim(0)`` has returned the free pages it
keeps (a leak grows it; the allocator's caching of freed memory does not); the raw RSS is
reported beside it. A guest that kills its agent ends ``env_crashed`` (visible, retryable, no
record) each attempt; every other episode must end final. A failure prints the seed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "baselines" / "tiny" / "baseline.toml"
RESUMES = 3
GUEST_MODES = (
    ("ok", 70),
    ("fail", 8),
    ("noresult", 6),
    ("kill-agent", 6),
    ("garbage", 5),
    ("timeout", 5),
)
ROUNDS = (
    ("batch", 50),
    ("session", 25),
    ("env-kill", 10),
    ("controller-kill", 10),
    ("store-full", 5),
    ("served", 6),
    ("store-s3", 6),
    ("ledger-full", 4),
    ("ray-node", 3),
)
RAY_MODES = tuple((m, w) for m, w in GUEST_MODES if m != "kill-agent")  # all final: no resume
KINDS_OF_PROBLEM = (
    ("duplicated:", "duplicated"),
    ("lost:", "lost"),
    ("disagrees:", "disagreeing"),
    ("env left:", "envs_left"),
    ("staging left:", "staging_left"),
)
S3_FAULTS = (("5xx", 0.3), ("5xx", 1.0), ("stall", 0.2))


@dataclass
class Tally:
    """What the soak saw, for the report."""

    episodes: int = 0
    rounds: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    resumes: int = 0
    lost: int = 0
    duplicated: int = 0
    disagreeing: int = 0
    envs_left: int = 0
    staging_left: int = 0
    problems: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)  # as the kernel counts it
    rss_held: list[int] = field(default_factory=list)  # once malloc gave back its free pages
    fds: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


def pick(rng: random.Random, weighted: tuple[tuple[str, int], ...]) -> str:
    return rng.choices([k for k, _ in weighted], weights=[w for _, w in weighted])[0]


def manifest(episode_id: str, seed: int, mode: str) -> dict[str, Any]:
    task: dict[str, Any] = {"mode": mode}
    limits: dict[str, Any] = {"timeout_s": 30}
    if mode == "timeout":
        task = {"mode": "sleep", "seconds": 60}
        limits = {"timeout_s": 1}
    if mode == "big":
        task = {"mode": "big", "bytes": 300_000}
    return {
        "episode_id": episode_id,
        "seed": seed,
        "policy": {"id": "soak", "version": "1"},
        "task": task,
        "limits": limits,
    }


def host_baseline() -> Any:
    """For the fake driver (entrypoints run on the host): the tiny entry script run by this
    Python, stored in the home like a built baseline (so ``cleanroom run`` finds its digest)."""
    import shutil

    from cleanroom.core.baseline_model import Baseline, Component, identity
    from cleanroom.core.limits import Limits
    from cleanroom.host.digests import digest_of, sha256_file
    from cleanroom.host.paths import baselines_dir, cache_dir

    entry = cache_dir() / "soak" / "entry.py"
    entry.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY.parent / "files" / "entry.py", entry)
    component = Component("entry.py", entry.stat().st_size, sha256_file(entry))
    argv = (sys.executable, str(entry))
    ident = identity(
        (component,), argv, Limits(timeout_s=30), "host", "0.1.0", "sha256:" + "0" * 64
    )
    digest = digest_of(ident)
    folder = baselines_dir() / digest.removeprefix("sha256:")
    spec = str(ident["spec_digest"])
    baseline = Baseline(
        digest, folder, spec, "soak-host", (component,), argv, Limits(timeout_s=30), "host", "0.1.0"
    )
    if not folder.exists():
        folder.mkdir(parents=True)
        shutil.copy(entry, folder / "entry.py")
        (folder / "baseline.json").write_text(json.dumps(baseline.to_json()))
    return baseline


def crashes_itself(item: dict[str, Any]) -> bool:
    """A guest that kills its own agent takes its env down: ``env_crashed`` every attempt."""
    return (item.get("task") or {}).get("mode") == "kill-agent"


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_and_fds() -> tuple[int, int, int]:
    """RSS; RSS once glibc's ``malloc_trim(0)`` returned the free pages it keeps (what is
    still held: a leak grows it, the allocator's caching does not); open descriptors."""
    import ctypes

    raw = rss()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: raw twice
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return raw, rss(), len(os.listdir("/proc/self/fd"))


class Soak:
    """One soak: ``run()`` draws rounds from ``seed`` and checks each; ``tally`` says what
    happened."""

    def __init__(
        self, seed: int, episodes: int, driver: str, work: Path, every_kind: bool = False
    ) -> None:
        self.rng = random.Random(seed)
        self.every_kind = every_kind  # each kind of round once first (seeded order)
        self.seed, self.target, self.driver_name, self.work = seed, episodes, driver, work
        self.tally = Tally()
        self.baseline: Any = None
        self.store = work / "store"
        self.round = 0
        self.round_store: str | None = None  # this round's store, when not ``store``
        self.s3: Any = None  # soak_faults.FaultyS3, started by the first store-s3 round
        self.key: str | None = None  # the served rounds' API key
        self.ray: Any = None  # soak_faults.RayNodes, started by the first ray-node round

    # -- the rounds --------------------------------------------------------------------------

    def _manifests(
        self, run: str, n: int, modes: tuple[tuple[str, int], ...]
    ) -> list[dict[str, Any]]:
        return [
            manifest(f"{run}-e{i}", self.rng.randrange(1000), pick(self.rng, modes))
            for i in range(n)
        ]

    async def _batch(
        self, run: str, items: list[dict[str, Any]], store: Path | None = None
    ) -> None:
        import cleanroom

        await cleanroom.arun(
            items,
            baseline=self.baseline,
            parallel=self.rng.choice((2, 4, 8)),
            store=str(store or self.round_store or self.store),
            run_id=run,
            driver=self.driver_name,
        )

    async def batch(self, run: str) -> list[dict[str, Any]]:
        items = self._manifests(run, self.rng.randint(4, 24), GUEST_MODES)
        await self._batch(run, items)
        return items

    async def session(self, run: str) -> list[dict[str, Any]]:
        import cleanroom
        from cleanroom.errors import CleanroomError

        ending = self.rng.choice(("finish", "finish", "raise", "kill-agent"))
        try:
            async with cleanroom.session(
                baseline=self.baseline,
                driver=self.driver_name,
                run_id=run,
                episode_id=f"{run}-s",
                store=str(self.store),
                timeout_s=60,
            ) as sb:
                for _ in range(self.rng.randint(1, 5)):
                    await sb.commands.run("echo soak; true")
                data = os.urandom(self.rng.randint(0, 200_000))
                await sb.files.write("/tmp/soak.bin", data)
                if await sb.files.read("/tmp/soak.bin") != data:
                    self.tally.problems.append(f"{run}: a file round trip changed the bytes")
                if ending == "kill-agent":
                    self.tally.count(self.tally.faults, "agent killed by its guest (session)")
                    with contextlib.suppress(Exception):
                        await sb.commands.run("kill -9 $PPID")
                if ending == "raise":
                    raise RuntimeError("the caller's own code failed")
                sb.finish(reward=1.0)
        except RuntimeError as exc:
            if "caller's own code" not in str(exc):
                raise
        except CleanroomError:
            pass  # the session's own outcome says what happened; checked below
        return [{"episode_id": f"{run}-s", "session": True}]

    async def env_kill(self, run: str) -> list[dict[str, Any]]:
        from cleanroom.ledger import Ledger

        items = [manifest(f"{run}-e{i}", i, "sleep") for i in range(self.rng.randint(2, 6))]
        for item in items:
            item["task"]["seconds"] = 2
        task = asyncio.create_task(self._batch(run, items))
        await asyncio.sleep(self.rng.uniform(0.2, 1.5))
        with Ledger() as ledger:
            live = [e for e in ledger.envs(run_id=run) if e.pid and e.destroyed_at is None]
        for env in live[: self.rng.randint(1, max(1, len(live)))]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(env.pid, signal.SIGKILL)
                self.tally.count(self.tally.faults, "env SIGKILL")
        await task
        return items

    def _cli(
        self, run: str, path: Path, store: Path, stderr: Path | None = None
    ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "cleanroom", "run", str(path), "--baseline"]
        argv += [self.baseline.digest, "--run-id", run, "--driver", self.driver_name]
        argv += ["--parallel", "4", "--store", str(store)]
        with open(stderr or os.devnull, "wb") as err:
            return subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "CI": "true"}
            )

    async def _until_an_env_is_ready(self, run: str, proc: subprocess.Popen[bytes]) -> None:
        from cleanroom.ledger import Ledger

        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with Ledger() as ledger:
                if any(e.ready_at for e in ledger.envs(run_id=run)):
                    return
            await asyncio.sleep(0.05)

    async def controller_kill(self, run: str) -> list[dict[str, Any]]:
        items = self._manifests(run, self.rng.randint(4, 12), GUEST_MODES)
        path = self.work / f"{run}.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in items))
        proc = self._cli(run, path, self.store)
        await self._until_an_env_is_ready(run, proc)
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        if proc.poll() is None:
            proc.kill()
            self.tally.count(self.tally.faults, "controller SIGKILL")
        proc.wait()
        again = self._cli(run, path, self.store)
        await asyncio.to_thread(again.wait, 300)
        return items

    async def store_full(self, run: str) -> list[dict[str, Any]]:
        items = [manifest(f"{run}-e{i}", i, "big") for i in range(self.rng.randint(3, 8))]
        if os.geteuid() != 0:
            await self._batch(run, items)
            return items
        small = self.work / f"{run}-small-store"
        small.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(small)], check=True)
        try:
            await self._batch(run, items, store=small)
            self.tally.count(self.tally.faults, "store ENOSPC")
            subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
            await self._batch(run, items, store=small)  # the resume, once there is room
            self.keep(run, self.check(run, items, store=small))
        finally:
            subprocess.run(["umount", "-l", str(small)], check=False)
        return []  # checked above, on its own store

    async def ledger_full(self, run: str) -> list[dict[str, Any]]:
        """``cleanroom run`` whose ledger's filesystem fills up mid-run; resumed once freed."""
        items = self._manifests(run, self.rng.randint(6, 16), GUEST_MODES)
        if os.geteuid() != 0:
            await self._batch(run, items)
            return items
        from cleanroom.drivers import get_driver
        from cleanroom.host.paths import baselines_dir
        from cleanroom.ledger import Ledger

        sub, fs = self.work / f"{run}-home", self.work / f"{run}-ledger-fs"
        sub.mkdir()
        fs.mkdir()
        (sub / "baselines").symlink_to(baselines_dir())
        (sub / "ledger.db").symlink_to(fs / "ledger.db")  # sqlite follows it: -wal, -shm too
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(fs)], check=True)
        before = os.environ.get("CLEANROOM_HOME")
        os.environ["CLEANROOM_HOME"] = str(sub)
        try:
            Ledger().close()
            path = self.work / f"{run}.jsonl"
            path.write_text("".join(json.dumps(m) + "\n" for m in items))
            err = self.work / f"{run}.stderr"
            proc = self._cli(run, path, self.store, stderr=err)
            await self._until_outcomes(run, proc, self.rng.randint(0, len(items) // 2))
            filled = fill(fs / "filler") if proc.poll() is None else False
            code = await asyncio.to_thread(proc.wait, 300)
            said = err.read_text(errors="replace")
            if filled:
                self.tally.count(self.tally.faults, "ledger ENOSPC")
                if code == 0 or "ledger" not in said.lower() or "Traceback" in said:
                    self.tally.problems.append(
                        f"round {self.round} ({run}): the ledger filled up, the controller "
                        f"exited {code}: {said[-600:]!r}"
                    )
            (fs / "filler").unlink(missing_ok=True)  # the space freed: a resume completes
            driver = get_driver(self.driver_name)
            with Ledger() as ledger:  # its rows may say live: their destroy was not written
                running = [e.env_id for e in ledger.envs(run_id=run) if driver.exists(e.env_id)]
            if running:
                self.tally.problems.append(
                    f"round {self.round} ({run}): envs running after the controller exited: "
                    f"{running}"
                )
            await self.settle(run, items)
            with Ledger() as ledger:
                for row in ledger.episodes(run):
                    self.tally.count(self.tally.outcomes, str(row.outcome))
            if left := driver.list_owned():
                self.tally.envs_left += len(left)
                self.tally.problems.append(f"round {self.round} ({run}): envs left {left}")
        finally:
            if before is None:
                os.environ.pop("CLEANROOM_HOME", None)
            else:
                os.environ["CLEANROOM_HOME"] = before
            subprocess.run(["umount", "-l", str(fs)], check=False)
        return []  # checked above, in its own home

    async def _until_outcomes(self, run: str, proc: subprocess.Popen[bytes], n: int) -> None:
        """Until ``n`` episodes of ``run`` have an outcome (or ``proc`` ended)."""
        from cleanroom.ledger import Ledger

        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            with Ledger() as ledger:
                if sum(1 for e in ledger.episodes(run) if e.outcome) >= n:
                    return
            await asyncio.sleep(0.05)

    async def store_s3(self, run: str) -> list[dict[str, Any]]:
        """A batch on an S3-compatible store (moto on loopback) answering a share of its
        requests with 500 / 503 or stalling them past the client's timeout; then resumed with
        the store healthy (``settle``)."""
        faults = _faults()
        if self.s3 is None:
            self.s3 = faults.FaultyS3(self.rng.randrange(1 << 30), self.work / "moto.log")
            self.s3.configure_here()
            self.s3.bucket("soak")
        self.round_store = "s3://soak/store"
        items = self._manifests(run, self.rng.randint(3, 10), GUEST_MODES)
        mode, share = self.rng.choice(S3_FAULTS)
        self.s3.faults(mode, share)
        self.tally.count(self.tally.faults, f"S3 {mode} on {share:.0%} of requests")
        from cleanroom.errors import CleanroomError

        try:
            await self._batch(run, items)
        except CleanroomError as exc:  # typed (a StoreError): resumed below
            self.tally.count(self.tally.faults, f"batch ended by {type(exc).__name__}")
        finally:
            self.s3.faults("ok", 0.0)
        return items

    async def ray_node(self, run: str) -> list[dict[str, Any]]:
        """A batch across a local Ray cluster (the fake driver): a node added for the round is
        SIGKILLed (its raylet) at a random moment once it runs an env; its episodes are queued
        again on the standing node. Then that node's home is reaped from the host alone, and
        every env in every node's ledger must be confirmed absent."""
        import cleanroom
        from cleanroom.drivers.fake import FakeDriver
        from cleanroom.integrations.ray import RayCluster
        from cleanroom.ledger import Ledger
        from cleanroom.lifecycle.context import RunOptions
        from cleanroom.lifecycle.reaper import reap
        from cleanroom.store import open_store

        if self.ray is None:  # Ray starts its nodes from the main thread only (signals)
            self.ray = _faults().RayNodes(self.work / "ray")
        name = f"node{self.round}"
        home = self.ray.add(name)
        items = self._manifests(run, self.rng.randint(4, 10), RAY_MODES)
        for item in items:
            if item["task"]["mode"] == "ok":  # long enough to be cut by the node's death
                item["task"] = {"mode": "sleep", "seconds": round(self.rng.uniform(0.5, 2), 2)}
        cluster = RayCluster(address=self.ray.address, reap_every_s=None)
        task = asyncio.create_task(
            cleanroom.arun(
                items,
                baseline=self.baseline,
                store=str(self.store),
                run_id=run,
                driver="fake",
                options=RunOptions(cleanup_window_s=5),
                cluster=cluster,
            )
        )
        node = Ledger(home / "ledger.db")
        try:
            deadline = time.monotonic() + 60
            while not task.done() and time.monotonic() < deadline:
                if any(e.ready_at for e in node.envs(run_id=run)):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))
            self.ray.kill(name)
            self.tally.count(
                self.tally.faults, "Ray node SIGKILL" + (" (after its run)" if task.done() else "")
            )
            await asyncio.wait_for(task, 180)
            pids = [e.pid for e in node.envs(run_id=run) if e.pid]
            await until_gone(pids, 30)
            await reap(FakeDriver(run_root=home / "run" / "fake"), node, open_store(self.store))
        finally:
            node.close()
            self.ray.remove(name)
        self.keep(run, self.node_envs_left(run))
        return items

    def node_envs_left(self, run: str) -> list[str]:
        """Every env of ``run`` in any node's ledger not confirmed absent, or still there."""
        from cleanroom.drivers.fake import FakeDriver
        from cleanroom.ledger import Ledger

        problems = []
        for home in self.ray.homes.values():
            driver = FakeDriver(run_root=home / "run" / "fake")
            with Ledger(home / "ledger.db") as ledger:
                for env in ledger.envs(run_id=run):
                    if env.confirmed_absent_at is None or driver.exists(env.env_id):
                        problems.append(f"env left: {env.env_id} on {home.name}")
        return problems

    async def served(self, run: str) -> list[dict[str, Any]]:
        """Sandboxes from the e2b SDK through a ``cleanroom serve`` subprocess (the fake
        driver): created, used, most killed by their client; the server SIGKILLed at a random
        moment (then started again: it reaps what the dead one left) or stopped by SIGTERM.
        Every sandbox it ever made (from the ledger: creates in flight at the SIGKILL too)
        ends with an outcome, its env confirmed absent; each its client killed ``completed``
        with its durable record."""
        from e2b import AsyncSandbox

        from cleanroom.host.paths import store_dir
        from cleanroom.ledger import Ledger
        from cleanroom.server.keys import KeyRing

        faults = _faults()
        self.round_store = str(store_dir())  # the server's: the home's store
        if self.key is None:
            self.key = KeyRing().create("soak")[1]
        srv = faults.Served(self.baseline.digest, self.work / "serve.log")
        await asyncio.to_thread(srv.start)
        os.environ.update({"E2B_API_URL": srv.url, "E2B_SANDBOX_URL": srv.url})
        with Ledger() as ledger:
            before = {r.run_id for r in ledger.list_runs() if r.run_id.startswith("serve-")}
        plans = [
            (self.rng.randint(0, 3), self.rng.randint(0, 50_000), self.rng.random() < 0.7)
            for _ in range(self.rng.randint(2, 6))
        ]
        killed: set[str] = set()

        async def client(cmds: int, size: int, kill: bool) -> None:
            with contextlib.suppress(Exception):  # the server may be SIGKILLed under it
                sbx = await AsyncSandbox.create("b", api_key=self.key, timeout=120)
                for _ in range(cmds):
                    await sbx.commands.run("true")
                await sbx.files.write(str(self.work / f"{sbx.sandbox_id}.bin"), b"s" * size)
                if kill and await sbx.kill():
                    killed.add(sbx.sandbox_id)

        clients = asyncio.gather(*(client(*plan) for plan in plans))
        if self.rng.random() < 0.6:
            await asyncio.sleep(self.rng.uniform(0.1, 3.0))
            if srv.proc.poll() is None:
                srv.kill()
                self.tally.count(self.tally.faults, "server SIGKILL")
            await clients
            await asyncio.to_thread(srv.start)  # reaps what the dead one left
        else:
            await clients
        code = await asyncio.to_thread(srv.stop)
        if code != 0:
            self.tally.problems.append(f"round {self.round} ({run}): serve exited {code}")
        with Ledger() as ledger:
            runs = sorted(
                r.run_id
                for r in ledger.list_runs()
                if r.run_id.startswith("serve-") and r.run_id not in before
            )
            outcomes = {r: [e.outcome for e in ledger.episodes(r)] for r in runs}
        for served_run in runs:
            sid = served_run.removeprefix("serve-")
            problems = self.check(served_run, [{"episode_id": sid, "session": True}])
            problems = [p for p in problems if "has no outcome" in p or "not final" not in p]
            if sid in killed and outcomes[served_run] != ["completed"]:
                problems.append(f"killed by its client but ended {outcomes[served_run]}")
            self.keep(served_run, problems)
        self.tally.count(self.tally.outcomes, "served sandboxes", len(runs))
        return []  # checked above, each sandbox its own run

    # -- the checks --------------------------------------------------------------------------

    def check(self, run: str, items: list[dict[str, Any]], store: Path | None = None) -> list[str]:
        """The run's problems (empty: every episode final, durable once, agreeing, cleaned)."""
        from cleanroom.core.states import Outcome
        from cleanroom.drivers import get_driver
        from cleanroom.host.paths import home
        from cleanroom.ledger import Ledger
        from cleanroom.store import open_store

        st = open_store(str(store or self.round_store or self.store))
        with Ledger() as ledger:
            rows = {r.episode_id: r for r in ledger.episodes(run)}
            envs = ledger.envs(run_id=run)
        problems = []
        records = st.list_records(run)
        ids = [r["episode_id"] for r in records]
        for dup in {i for i in ids if ids.count(i) > 1}:
            problems.append(f"duplicated: {dup}")
        by_id = {r["episode_id"]: r for r in records}
        for item in items:
            eid = item["episode_id"]
            row = rows.get(eid)
            if row is None or row.outcome is None:
                problems.append(f"not final: {eid} has no outcome")
                continue
            if not Outcome(row.outcome).final:
                if not crashes_itself(item):
                    problems.append(f"not final: {eid} ({row.outcome})")
                continue  # visible, retryable, no record by design
            record = by_id.get(eid)
            if record is None:
                problems.append(f"lost: {eid} ended {row.outcome} with no durable record")
            elif record["outcome"] != row.outcome or record["attempt"] != row.attempt:
                problems.append(f"disagrees: {eid} ledger {row.outcome}/{row.attempt}")
        driver = get_driver(self.driver_name)
        for env in envs:
            if driver.exists(env.env_id) or env.live:
                problems.append(f"env left: {env.env_id}")
        staging = home() / "staging" / run
        if staging.exists() and any(staging.rglob("*")):
            problems.append(f"staging left: {staging}")
        return problems

    def keep(self, run: str, problems: list[str]) -> None:
        """The problems a run ended with (after its resumes), counted by kind."""
        for prefix, attr in KINDS_OF_PROBLEM:
            n = sum(1 for p in problems if p.startswith(prefix))
            setattr(self.tally, attr, getattr(self.tally, attr) + n)
        self.tally.problems += [f"round {self.round} ({run}): {p}" for p in problems]

    async def settle(self, run: str, items: list[dict[str, Any]]) -> None:
        """Resume the run until every episode is final (a non-final outcome is retryable)."""
        problems = self.check(run, items)
        resumes = 0
        batch_items = [i for i in items if not i.get("session")]
        while (
            any(p.startswith("not final") for p in problems) and batch_items and resumes < RESUMES
        ):
            resumes += 1
            self.tally.resumes += 1
            await self._batch(run, batch_items)
            problems = self.check(run, items)
        if items and items[0].get("session"):  # a session is not resumed: any outcome it
            problems = [p for p in problems if "has no outcome" in p or "not final" not in p]
        self.keep(run, problems)

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, progress: bool = True) -> Tally:
        from cleanroom.baseline.resolve import resolve_baseline

        self.baseline = host_baseline() if self.driver_name == "fake" else resolve_baseline(TINY)
        started = time.monotonic()
        kinds = tuple(r for r in ROUNDS if r[0] not in self.cannot_run())
        try:
            await self._rounds(kinds, progress)
        except BaseException:
            self.close()
            raise
        self.finish()
        self.tally.seconds = time.monotonic() - started
        return self.tally

    def cannot_run(self) -> set[str]:
        """The kinds of round this host or driver cannot run."""
        import importlib.util

        out = set()
        if os.geteuid() != 0:
            out |= {"store-full", "ledger-full"}  # their tmpfs mounts
        if self.driver_name != "fake" or importlib.util.find_spec("ray") is None:
            out.add("ray-node")
        return out

    async def _rounds(self, kinds: tuple[tuple[str, int], ...], progress: bool) -> None:
        from cleanroom.ledger import Ledger

        first = self.rng.sample([k for k, _ in kinds], len(kinds)) if self.every_kind else []
        while self.tally.episodes < self.target or first:
            self.round += 1
            self.round_store = None
            kind = first.pop(0) if first else pick(self.rng, kinds)
            run = f"soak{self.seed}-{self.round}-{kind}"
            items = await getattr(self, kind.replace("-", "_"))(run)
            await self.settle(run, items)
            with Ledger() as ledger:
                for row in ledger.episodes(run):
                    self.tally.count(self.tally.outcomes, str(row.outcome))
            self.tally.episodes += max(1, len(items))
            self.tally.count(self.tally.rounds, kind)
            if set(self.tally.rounds) == {k for k, _ in kinds}:  # every kind ran: warmed up
                raw, held, fds = rss_and_fds()
                self.tally.rss.append(raw)
                self.tally.rss_held.append(held)
                self.tally.fds.append(fds)
            if progress and self.round % 10 == 0:
                print(
                    f"soak: round {self.round}, {self.tally.episodes}/{self.target} episodes, "
                    f"{len(self.tally.problems)} problems",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        """Stop what the rounds started beside this process: moto, the Ray cluster."""
        if self.s3 is not None:
            self.s3.close()
            self.tally.faults.update({f"S3 {k} (requests)": v for k, v in self.s3.counts.items()})
            self.s3 = None
        if self.ray is not None:
            self.ray.close()
            self.ray = None

    def finish(self) -> None:
        from cleanroom.drivers import get_driver

        self.close()

        left = get_driver(self.driver_name).list_owned()
        if left:
            self.tally.envs_left += len(left)
            self.tally.problems.append(f"the driver still owns {left}")
        held = ("RSS held (after malloc_trim)", self.tally.rss_held)
        for name, series in (held, ("open fds", self.tally.fds)):  # raw RSS: reported only
            growth = flat_growth(series)
            if growth is not None and growth > 0.10:
                self.tally.problems.append(
                    f"{name} grew {growth:.0%} from the first to the last 10%"
                )


async def until_gone(pids: list[int], timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until none of ``pids`` is alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                alive.append(pid)
        if not alive:
            return
        await asyncio.sleep(0.1)


def fill(path: Path) -> bool:
    """Write ``path`` until its filesystem is full (ENOSPC); True once it is."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1 << 9):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return True


def _faults() -> Any:
    """``bench/soak_faults.py`` (beside this file), loaded by its path (``bench/`` stays off
    ``sys.path`` when this file is imported as a module, as the suite does)."""
    import importlib.util

    if "soak_faults" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "soak_faults", Path(__file__).resolve().parent / "soak_faults.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["soak_faults"] = module
        spec.loader.exec_module(module)
    return sys.modules["soak_faults"]


def flat_growth(series: list[int]) -> float | None:
    """Growth of the mean of the last 10% over the first 10% (None under 20 samples)."""
    if len(series) < 20:
        return None
    tenth = max(2, len(series) // 10)
    first, last = series[:tenth], series[-tenth:]
    return (sum(last) / len(last)) / (sum(first) / len(first)) - 1


def report(tally: Tally, seed: int, driver: str) -> str:
    lines = [
        f"soak: seed {seed}, driver {driver}, {tally.episodes} episodes in "
        f"{sum(tally.rounds.values())} rounds, {tally.seconds:.0f} s",
        f"  rounds:   {json.dumps(tally.rounds, sort_keys=True)}",
        f"  faults:   {json.dumps(tally.faults, sort_keys=True)}",
        f"  outcomes (every attempt): {json.dumps(tally.outcomes, sort_keys=True)}",
        f"  resumes:  {tally.resumes}",
        f"  lost {tally.lost}, duplicated {tally.duplicated}, disagreeing {tally.disagreeing}, "
        f"envs left {tally.envs_left}, staging left {tally.staging_left}",
    ]
    series_of = (
        ("RSS", tally.rss),
        ("RSS held (after malloc_trim)", tally.rss_held),
        ("open fds", tally.fds),
    )
    for name, series in series_of:
        growth = flat_growth(series)
        if series:
            lines.append(
                f"  {name}: first {series[0]}, last {series[-1]}, growth "
                + (f"{growth:+.1%}" if growth is not None else "n/a (few rounds)")
            )
    lines.append(f"  problems: {len(tally.problems)}")
    lines += [f"    {p}" for p in tally.problems[:40]]
    if tally.problems:
        lines.append(f"  {reproduce(seed, driver)}")
    return "\n".join(lines) + "\n"


def reproduce(seed: int, driver: str) -> str:
    return f"reproduce: python bench/soak.py --seed {seed} --driver {driver}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--driver", default="fake")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import tempfile

    print(f"soak: seed {args.seed}, driver {args.driver}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="cleanroom-soak-") as tmp:
        soak = Soak(args.seed, args.episodes, args.driver, Path(tmp))
        try:
            tally = asyncio.run(soak.run())
        except BaseException:
            print(f"soak: FAILED in round {soak.round}; {reproduce(args.seed, args.driver)}")
            raise
    text = report(tally, args.seed, args.driver)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if tally.problems else 0


if __name__ == "__main__":
    sys.exit(main())

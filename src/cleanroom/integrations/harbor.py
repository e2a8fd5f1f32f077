"""A Harbor environment provider: every Harbor trial in a fresh cleanroom VM, run as a session.

    harbor run -p TASK -a oracle -e cleanroom.integrations.harbor:CleanroomEnvironment -n 4

Harbor (PyPI ``harbor`` 0.25, Python >= 3.12; ``pip install 'cleanroom[harbor]'``) loads this
class by its import path; nothing in Harbor changes and nothing else in cleanroom imports this
module. ``start`` resolves the task's environment to a baseline (``environment/cleanroom.toml``,
a spec; else the task's ``docker_image``; else ``environment/Dockerfile``) and opens a
``cleanroom.sessions`` (a run of its own, ``harbor-<trial>``; the manifest's ``task`` names
Harbor's task, trial and trial id); an image that sets an ``Entrypoint`` has it started in the
background first, with Harbor's keepalive command as its arguments, as Harbor's Docker
environment starts the container (a service the image's entrypoint starts is up for the
healthcheck). ``exec`` runs the shell string (the exit code is data);
files and folders travel through the session's ``put``/``get`` (folders as tar). ``stop`` ends
the session: the transcript and the record (the reward Harbor's verifier wrote, read from the
trial folder, which is never written) are exported, the VM destroyed and confirmed absent in
the ledger, or ``stop`` raises. A trial Harbor cancelled ends ``cancelled``. No VM is ever kept
(``delete=False`` is logged and ignored). Network: ``no-network`` is no network at all (even on
a baseline with an allowlist); an ``allowlist`` becomes the session's egress allowlist (each
host on ports 443 and 80, within the baseline's ``network.allow``); ``public`` is refused, since
cleanroom never gives a guest the open internet, and fails only that task's trial, unless the
operator says on purpose what ``public`` means for this job: ``--ek public_as=HOST,HOST``, an
allowlist the egress machinery enforces as for an ``allowlist`` task.

Options (``--ek key=value``): ``driver`` (qemu or gvisor, or auto; default qemu), ``store`` (a
folder or URL; default the cleanroom home's store), ``public_as`` (above; default none).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import math
import re
import shlex
import tarfile
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import (
    BaseEnvironment,
    ExecResult,
    SandboxBuildFailedError,
    transfer_tar_filter,
)
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy

from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.loops import loop_lock
from cleanroom.drivers import get_driver
from cleanroom.errors import CleanroomError, ConfigError
from cleanroom.host import paths
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import AsyncSession, session
from cleanroom.store import open_store

__all__ = ["CleanroomEnvironment", "baseline_spec_for", "egress_allowlist"]

SPEC_NAME = "cleanroom.toml"
_TRANSFER_DIR = PurePosixPath("/tmp")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
WEB_PORTS = (443, 80)  # Harbor's allowlist names hosts, cleanroom's HOST:PORT
REWARDS_MAX = 64 * 1024  # a reward.json larger than this is not read
PUT_CHUNK = 512 * 1024  # well inside the guest agent's 1 MiB frame
SESSION_LIMIT_S = 4 * 3600  # a written spec's timeout_s: past it the deadman ends the VM
KEEPALIVE = ("sh", "-c", "sleep infinity")  # the command Harbor's docker compose files give


def _ident(text: str, limit: int = 100) -> str:
    """``text`` as a run or episode id (letters, digits, ``._-``; starting with one of the
    first two)."""
    cleaned = _UNSAFE.sub("-", text).strip("-._") or "trial"
    return cleaned[:limit]


def _base(environment_dir: Path, config: EnvironmentConfig) -> str | None:
    """The ``[base]`` line of a spec for a task without its own: its ``docker_image``, else
    its ``environment/Dockerfile``; None when it has neither."""
    if config.docker_image:
        return f"image = {json.dumps('docker://' + config.docker_image.removeprefix('docker://'))}"
    dockerfile = environment_dir / "Dockerfile"
    if dockerfile.is_file():
        return f"dockerfile = {json.dumps(str(dockerfile.resolve()))}"
    return None


def _check_definition(environment_dir: Path, config: EnvironmentConfig) -> None:
    if not (environment_dir / SPEC_NAME).is_file() and _base(environment_dir, config) is None:
        raise ConfigError(
            f"{environment_dir}: no {SPEC_NAME}, docker_image or Dockerfile to build the "
            "cleanroom baseline from"
        )


def baseline_spec_for(environment_dir: Path, config: EnvironmentConfig, name: str) -> Path:
    """The spec a task's environment is built from: its own ``environment/cleanroom.toml``;
    else one written under the cleanroom home for its ``docker_image`` or its
    ``environment/Dockerfile`` (the task folder is never written), with the task's cpus and
    memory, a session lifetime of ``SESSION_LIMIT_S`` and an entrypoint that is never run (an
    image need not have one). ``ConfigError`` names the folder when there is none of them."""
    _check_definition(environment_dir, config)
    own, base = environment_dir / SPEC_NAME, _base(environment_dir, config)
    if own.is_file() or base is None:
        return own
    limits = [f"timeout_s = {SESSION_LIMIT_S}"]
    if config.cpus:
        limits.append(f"vcpus = {max(1, math.ceil(config.cpus))}")
    if config.memory_mb:
        limits.append(f"memory_mib = {config.memory_mb}")
    text = "\n".join(
        [
            f"name = {json.dumps(_ident(name.lower(), 60))}",
            *("", "[base]", base),
            *("", "[entrypoint]", 'command = ["true"]'),  # never run: Harbor sends commands
            *("", "[limits]", *limits, ""),
        ]
    )
    folder = paths.home() / "harbor" / "specs" / hashlib.sha256(text.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "baseline.toml"
    if not spec.is_file() or spec.read_text() != text:
        scratch = folder / f".baseline.toml.{uuid.uuid4().hex}"
        scratch.write_text(text)
        scratch.replace(spec)  # whole, for another Harbor process reading it now
    return spec


def egress_allowlist(policy: NetworkPolicy) -> list[str]:
    """Harbor's network policy as a session's egress allowlist: ``no-network`` is ``[]`` (none,
    whatever the baseline allows); each allowlist host (a name, ``*.`` wildcard, address or
    CIDR) on the web ports, which the baseline's ``network.allow`` must cover."""
    if policy.network_mode != NetworkMode.ALLOWLIST:
        return []
    hosts = [f"[{h}]" if ":" in h else h for h in policy.allowed_hosts]
    return [f"{host}:{port}" for host in hosts for port in WEB_PORTS]


def _argv(command: str, user: str | int | None) -> list[str]:
    """The guest argv that runs ``command`` in bash as ``user`` (None or root: as the agent)."""
    shell = ["bash", "-c", command]
    if user is None or user in ("root", 0, "0"):
        return shell
    if isinstance(user, int) or user.isdigit():
        return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *shell]
    return ["runuser", "-u", user, "--", *shell]


def _vm_driver(name: str) -> str:
    """``name`` if it is a driver that isolates the guest: the fake driver runs the "guest" as
    a process on this host, where Harbor's commands (``/solution``, ``/logs``) would land."""
    if name == "fake":
        raise ConfigError(
            "driver 'fake' runs commands on this host, not in a VM: use qemu or gvisor"
        )
    return name


def _return_code(exit_code: int | None, signal: int | None) -> int:
    if exit_code is not None:
        return exit_code
    return 128 + (signal or 0)


class CleanroomEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor has no stubs here
    """One Harbor trial's environment: one cleanroom session on a fresh VM (module docstring)."""

    def __init__(
        self,
        *args: Any,
        driver: str = "qemu",
        store: str | None = None,
        public_as: str | None = None,
        **kwargs: Any,
    ):
        self._driver_name = _vm_driver(driver)
        self._public_as = [h.strip() for h in (public_as or "").split(",") if h.strip()]
        self._store_ref = store
        self._session_cm: contextlib.AbstractAsyncContextManager[AsyncSession] | None = None
        self._sb: AsyncSession | None = None
        self._ledger: Ledger | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._interrupted = False  # a command was cut short while the guest ran it
        self._refusal: str | None = None  # a policy refused while Harbor builds the trial
        self._building = True
        super().__init__(*args, **kwargs)
        self._building = False

    # -- what Harbor asks before a trial --------------------------------------------------------

    @staticmethod
    def type() -> str:
        return "cleanroom"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv6_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            network_allowlist_ipv6_cidrs=True,
        )

    def _validate_definition(self) -> None:
        try:
            _check_definition(self.environment_dir, self.task_env_config)
        except ConfigError as exc:
            raise FileNotFoundError(str(exc)) from exc

    def validate_network_policy_support(self, network_policy: NetworkPolicy | None = None) -> None:
        """Refuse ``public``. Harbor builds every trial's environment while it plans the job,
        and a refusal raised then ended the whole job (no later trial ran): it is kept, and
        ``start`` raises it, so only this task's trial fails, with the reason. At run time (a
        step's policy switch) it raises at once, failing that trial."""
        policy = network_policy or self.network_policy
        if policy.network_mode == NetworkMode.PUBLIC and not getattr(self, "_public_as", None):
            why = (
                "network_mode='public' is not supported by the cleanroom environment: a "
                "guest never reaches the open internet. Set [environment] network_mode = "
                "'no-network' in task.toml."
            )
            if getattr(self, "_building", False):
                self._refusal = self._refusal or why
                return
            raise ValueError(why)
        super().validate_network_policy_support(network_policy)

    # -- lifecycle ------------------------------------------------------------------------------

    def _egress(self) -> list[str]:
        """The session's egress allowlist: a ``public`` task gets the operator's
        ``public_as`` hosts (validation refused it without them), any other Harbor's policy."""
        policy = self.network_policy
        if policy.network_mode == NetworkMode.PUBLIC:
            return egress_allowlist(
                NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=self._public_as)
            )
        return egress_allowlist(policy)

    async def _baseline(self, force_build: bool) -> Baseline:
        spec = baseline_spec_for(self.environment_dir, self.task_env_config, self.environment_name)
        async with loop_lock("harbor-build"):
            try:
                return await asyncio.to_thread(resolve_or_build, str(spec))
            except CleanroomError as exc:
                raise SandboxBuildFailedError(f"{spec}: {exc}") from exc

    async def start(self, force_build: bool) -> None:
        """Build (or find) the baseline, then open the trial's session on a fresh VM."""
        if self._session_cm is not None:
            raise CleanroomError(f"{self.session_id}: already started")
        if self._refusal is not None:
            raise ValueError(self._refusal)  # this trial only, before anything starts
        baseline = await self._baseline(force_build)
        self._ledger = Ledger()
        trial = {
            "task": self.environment_name,
            "trial": self.session_id,
            "trial_id": str(self.context_id) if self.context_id else None,
            "environment_id": self.environment_id,
        }
        cm = session(
            baseline,
            driver=get_driver(self._driver_name),
            ledger=self._ledger,
            store=open_store(self._store_ref),
            policy={"id": "harbor"},
            task={"harbor": trial},
            episode_id=_ident(self.environment_name),
            run_id="harbor-" + _ident(self.session_id),
            options=RunOptions(parallel=1, spares=0),
            network=self._egress(),
        )
        self._owner = asyncio.current_task()
        try:
            self._sb = await cm.__aenter__()
        except BaseException:
            self._close_ledger()
            raise
        self._session_cm = cm
        entry = baseline.image_entrypoint
        if entry:  # as Harbor's Docker environment starts the container: ENTRYPOINT + KEEPALIVE
            await self._sb.commands.run([*entry, *KEEPALIVE], background=True)
        # Harbor's log folders (no host mounts: they travel by download_dir), and for a
        # docker_image task its environment/ files, as on Harbor's other sandbox providers.
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Export the evidence, destroy the VM and confirm it absent (or raise)."""
        if not delete:
            self.logger.warning(
                "cleanroom never keeps a VM: %s is destroyed anyway", self.session_id
            )
        cm, sb = self._session_cm, self._sb
        if cm is None or sb is None:
            self._close_ledger()
            return
        self._session_cm = None
        owner = self._owner
        try:
            if owner is not None and owner.cancelling() > 0:  # Harbor cancelled the trial
                stop = asyncio.CancelledError(f"harbor cancelled trial {self.session_id}")
                try:
                    await cm.__aexit__(asyncio.CancelledError, stop, None)
                except asyncio.CancelledError as exc:
                    if exc is not stop:
                        raise
            else:
                self._finish(sb)
                await cm.__aexit__(None, None, None)
            self._confirm_absent(sb)
        finally:
            self._close_ledger()

    def _finish(self, sb: AsyncSession) -> None:
        """The reward Harbor's verifier left in the trial folder (read, never written) as the
        session's result; for a multi-step task, the steps' rewards (``steps/<name>/verifier``)
        combined as Harbor combines them (``_step_reward``). A trial without one ends
        ``episode_error`` (no ``finish``)."""
        info: dict[str, Any] = {"harbor_trial": self.session_id}
        try:
            rewards = _rewards_in(self.trial_paths.verifier_dir)
            if rewards is None:
                rewards, steps = self._step_reward()
                info["step_rewards"] = steps
            reward = rewards.get("reward") if rewards is not None else None
            if isinstance(reward, int | float) and not isinstance(reward, bool):
                sb.finish(float(reward), {**info, "rewards": rewards})
        except (OSError, ValueError) as exc:
            self.logger.warning("no reward for %s: %s", self.session_id, exc)

    def _step_reward(self) -> tuple[dict[str, float] | None, dict[str, dict[str, float]]]:
        """A multi-step trial's reward from its steps' verifier folders, in the task's step
        order: the last step's (``multi_step_reward_strategy = "final"``) or each key's mean
        over the steps that have one, a missing key counting 0 (``mean``, Harbor's default)."""
        config = _task_config(self.environment_dir.parent)
        steps: dict[str, dict[str, float]] = {}
        for step in (config.steps or []) if config is not None else []:
            found = _rewards_in(self.trial_paths.trial_dir / "steps" / step.name / "verifier")
            if found is not None:
                steps[step.name] = found
        if not steps:
            return None, steps
        strategy = getattr(config, "multi_step_reward_strategy", None)
        if strategy is not None and str(getattr(strategy, "value", strategy)) == "final":
            return list(steps.values())[-1], steps
        keys = {key for found in steps.values() for key in found}
        mean = {k: sum(found.get(k, 0.0) for found in steps.values()) / len(steps) for k in keys}
        return mean, steps

    def _confirm_absent(self, sb: AsyncSession) -> None:
        assert self._ledger is not None
        run_id = sb.episode.key.run_id
        envs = self._ledger.envs(run_id=run_id)
        left = [e.env_id for e in envs if e.confirmed_absent_at is None]
        if not envs or left:
            raise CleanroomError(
                f"{self.session_id}: cleanroom could not confirm its VM absent "
                f"(run {run_id}: {', '.join(left) or 'no env row'}); see `cleanroom ps`"
            )

    def _close_ledger(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def _session(self) -> AsyncSession:
        if self._sb is None or self._session_cm is None:
            raise CleanroomError(f"{self.session_id}: not started, or stopped")
        if self._interrupted:
            raise CleanroomError(
                f"{self.session_id}: a command was cut short (cancelled, or Harbor's timeout) "
                "while the guest ran it; the guest agent takes one request at a time, so this "
                "VM takes no more"
            )
        return self._sb

    # -- commands and files ---------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run the shell string in the guest; a non-zero exit is data, not an error."""
        sb = self._session()
        try:
            r = await sb.exec(
                _argv(command, self._resolve_user(user)),
                timeout_s=float(timeout_sec) if timeout_sec else None,
                env=self._merge_env(env),
                cwd=cwd or self.task_env_config.workdir,
                user="root",  # _argv drops to the task's user itself
            )
        except asyncio.CancelledError:
            self._interrupted = True
            raise
        if r.timed_out:  # as Harbor's own providers say it; the transcript has the output
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(
            stdout=r.stdout.decode(errors="replace"),
            stderr=r.stderr.decode(errors="replace"),
            return_code=_return_code(r.exit_code, r.signal),
        )

    async def _root(self, command: str) -> None:
        r = await self.exec(command, user="root")
        if r.return_code != 0:
            raise CleanroomError(f"{command!r} failed ({r.return_code}): {r.stderr or r.stdout}")

    async def _put(self, path: str, data: bytes, mode: int) -> None:
        """``data`` at ``path`` in the guest: one put, or parts joined there (a put is one
        frame, and the guest agent takes frames up to 1 MiB)."""
        sb = self._session()
        if len(data) <= PUT_CHUNK:
            await sb.put(path, data, mode)
            return
        parts = [f"{path}.part{i:06d}" for i in range(0, len(data), PUT_CHUNK)]
        for i, part in enumerate(parts):
            await sb.put(part, data[i * PUT_CHUNK : (i + 1) * PUT_CHUNK], 0o600)
        target = shlex.quote(path)
        await self._root(
            f"cat {' '.join(shlex.quote(p) for p in parts)} > {target}; s=$?;"
            f" rm -f {' '.join(shlex.quote(p) for p in parts)}; chmod {mode:o} {target}; exit $s"
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        parent = str(PurePosixPath(target_path).parent)
        await self._root(f"mkdir -p {shlex.quote(parent)}")
        await self._put(target_path, source.read_bytes(), source.stat().st_mode & 0o777)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """The folder as one tar stream, unpacked in the guest under ``target_dir``."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(Path(source_dir), arcname=".")
        staged = str(_TRANSFER_DIR / f".cleanroom-up-{uuid.uuid4().hex}.tar")
        await self._put(staged, buffer.getvalue(), 0o600)
        target, tmp = shlex.quote(target_dir), shlex.quote(staged)
        await self._root(
            f"mkdir -p {target} && tar -xf {tmp} -C {target} --no-same-owner; s=$?; rm -f {tmp};"
            " exit $s"
        )

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._session().get(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """The guest folder as one tar stream; unpacked with the data filter (the guest is
        untrusted: no absolute paths, no climbing out, no links out, no device nodes)."""
        staged = str(_TRANSFER_DIR / f".cleanroom-down-{uuid.uuid4().hex}.tar")
        await self._root(f"tar -cf {shlex.quote(staged)} -C {shlex.quote(source_dir)} .")
        try:
            data = await self._session().get(staged)
        finally:
            await self._root(f"rm -f {shlex.quote(staged)}")
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(path=target, filter=_guest_member)


def _rewards_in(folder: Path) -> dict[str, float] | None:
    """The rewards a verifier wrote in ``folder``: ``reward.txt`` (one number: ``reward``) or
    ``reward.json`` (numbers by key), read as data the guest wrote (a bounded size)."""
    text, data = folder / "reward.txt", folder / "reward.json"
    if text.is_file():
        with text.open("rb") as f:  # the guest wrote it: read a number's worth
            return {"reward": float(f.read(64).decode().strip())}
    if data.is_file() and data.stat().st_size <= REWARDS_MAX:
        rewards = json.loads(data.read_text())
        if isinstance(rewards, dict):
            return {
                str(k): float(v)
                for k, v in rewards.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
    return None


def _task_config(task_dir: Path) -> Any:
    """The task's ``task.toml`` as Harbor reads it (None if it cannot be read)."""
    from harbor.models.task.config import TaskConfig

    try:
        return TaskConfig.model_validate_toml((task_dir / "task.toml").read_text())
    except Exception:  # a task Harbor ran but we cannot read: no step reward
        return None


def _guest_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Harbor's transfer filter (the data filter, device nodes skipped), sparse members skipped
    too: their size is the guest's word, not the bytes that came."""
    if member.issparse() or member.type == tarfile.GNUTYPE_SPARSE:
        return None
    return transfer_tar_filter(member, dest)  # type: ignore[no-any-return]

"""The Harbor provider, run by the real Harbor CLI (``harbor run``) on real VMs.

Harbor needs Python >= 3.12: ``scripts/harbor-python.sh`` builds CPython 3.13 from Debian's
source once (cached under ``~/.cache/cleanroom/``) and a venv with ``harbor==0.25.*`` and this
checkout. These tests drive ``harbor`` as a user would, then read what Harbor wrote (its job
folder) and what cleanroom kept (ledger, store). ``harbor`` runs in a network namespace with no
interface (``unshare -n``; the image tests excepted, whose registry is on this machine's
loopback), with ``HARBOR_TELEMETRY=0`` and a ``HOME`` of its own. Select them with ``-m harbor``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.baseline.rootfs import debootstrap_tarball
from cleanroom.baseline.spec import BaseSection
from cleanroom.drivers.base import RunFolderDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from ..baseline.conftest import needs_root_tools, registry
from ..baseline.ociutil import Entry, layer_bytes, layout
from ..conftest import ROOT
from ..vmkit import assert_nothing_left

pytestmark = [pytest.mark.harbor, pytest.mark.vm, pytest.mark.timeout(1500)]

TASK = Path(__file__).parent / "harbor_task"
PROVIDER = "cleanroom.integrations.harbor:CleanroomEnvironment"
__all__ = ["registry"]  # a fixture (a real registry on 127.0.0.1), used by name


@pytest.fixture(scope="module")
def harbor() -> Path:
    """The ``harbor`` CLI of the venv the setup script makes (built once, then cached)."""
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (make setup installs it)")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "harbor-python.sh")],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=3600,
    )
    python = Path(done.stdout.strip().splitlines()[-1])
    return python.parent / "harbor"


def _task(tmp_path: Path, solve: str | None = None, test: str | None = None, **toml: str) -> Path:
    """A copy of the test task: another ``solve.sh`` or ``tests/test.sh`` when given, and
    ``task.toml`` lines replaced (``network='network_mode = "public"'``: the line starting
    with ``network``; ``agent``, ``environment``: lines added to that section)."""
    task = tmp_path / "hello-cleanroom"
    shutil.copytree(TASK, task)
    for path, script in (("solution/solve.sh", solve), ("tests/test.sh", test)):
        if script is not None:
            (task / path).write_text("#!/bin/bash\n" + script + "\n")
    config = task / "task.toml"
    lines = config.read_text().splitlines()
    if "network" in toml:
        lines = [toml["network"] if line.startswith("network") else line for line in lines]
    for section in ("agent", "environment"):
        if section in toml:
            lines.insert(lines.index(f"[{section}]") + 1, toml[section])
    config.write_text("\n".join(lines) + "\n")
    return task


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        **os.environ,
        "HOME": str(home),  # Harbor's own state stays in the test's folder
        "HARBOR_TELEMETRY": "0",  # nothing leaves the machine
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",  # Harbor's rich output, wrapped less
    }


def _offline() -> list[str]:
    """A prefix that runs a command in a network namespace of its own with no interface at all:
    nothing Harbor or cleanroom does can leave the machine (or reach it)."""
    return ["unshare", "-n", "--"] if os.geteuid() == 0 else ["unshare", "-r", "-n", "--"]


def _command(
    harbor: Path,
    task: Path,
    jobs: Path,
    store: Path,
    n: int,
    *,
    offline: bool = True,
    driver: str = "qemu",
    ek: tuple[str, ...] = (),
) -> list[str]:
    return [
        *(_offline() if offline else []),
        str(harbor),
        "run",
        "-p",
        str(task),
        "-a",
        "oracle",
        "-e",
        PROVIDER,
        "--ek",
        f"store={store}",
        "--ek",
        f"driver={driver}",
        *(arg for pair in ek for arg in ("--ek", pair)),
        "-k",
        str(n),
        "-n",
        str(n),
        "-o",
        str(jobs),
        "-y",
    ]


def _trials(jobs: Path) -> list[dict[str, object]]:
    """Each trial's ``result.json`` in Harbor's job folder."""
    return [json.loads(p.read_text()) for p in sorted(jobs.glob("*/*/result.json"))]


def _reward(trial: dict[str, object]) -> float | None:
    verifier = trial.get("verifier_result") or {}
    assert isinstance(verifier, dict)
    rewards = verifier.get("rewards") or {}
    assert isinstance(rewards, dict)
    value = rewards.get("reward")
    return float(value) if value is not None else None


def _runs(ledger: Ledger) -> list[str]:
    return [r.run_id for r in ledger.list_runs() if r.run_id.startswith("harbor-")]


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    with Ledger() as ledger:
        yield ledger


def _harbor(
    harbor: Path, tmp_path: Path, task: Path, n: int, **how: Any
) -> subprocess.CompletedProcess[str]:
    jobs, store = tmp_path / "jobs", tmp_path / "store"
    return subprocess.run(
        _command(harbor, task, jobs, store, n, **how),
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1200,
    )


def _run(
    harbor: Path, tmp_path: Path, task: Path, n: int, expect: int | None = None, **how: Any
) -> tuple[list[dict[str, object]], Path]:
    """``harbor run`` of ``n`` trials of ``task`` (``how``: ``offline``, ``driver``), which
    must succeed: each trial's result (``expect`` of them: ``n`` unless a dataset)."""
    done = _harbor(harbor, tmp_path, task, n, **how)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trials = _trials(tmp_path / "jobs")
    assert len(trials) == (expect or n), done.stdout[-4000:]
    return trials, tmp_path / "store"


def _check_cleanroom(
    ledger: Ledger,
    store: Path,
    before: set[str],
    trials: list[dict[str, object]],
    reward: float,
    driver: RunFolderDriver | None = None,
) -> None:
    """Each trial is one cleanroom run: its env confirmed absent, its record durable with the
    reward Harbor's verifier gave and Harbor's trial named in its task."""
    runs = sorted(set(_runs(ledger)) - before)
    assert len(runs) == len(trials)
    names = {str(t["trial_name"]) for t in trials}
    local = LocalStore(store)
    for run_id in runs:
        assert_nothing_left(driver or QemuDriver(), ledger, run_id, local)
        [row] = ledger.episodes(run_id)
        record = local.get_record(run_id, row.episode_id)
        assert record is not None and record["outcome"] == "completed", record
        assert record["reward"] == reward
        trial = record["task"]["harbor"]["trial"]
        assert any(trial.startswith(name) for name in names), (trial, names)


def test_oracle_solves_every_trial_in_its_own_vm(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects: ``harbor run -e cleanroom...`` with 4 concurrent trials: the oracle's solution
    reaches each fresh VM (``upload_dir``), the verifier's reward comes back (``download_dir``)
    as 1 on every trial, and each trial leaves a completed record and a confirmed-absent VM."""
    before = set(_runs(ledger))
    trials, store = _run(harbor, tmp_path, _task(tmp_path), 4)
    assert [_reward(t) for t in trials] == [1.0] * 4, trials
    assert all(t.get("exception_info") is None for t in trials), trials
    _check_cleanroom(ledger, store, before, trials, 1.0)


def test_the_gvisor_driver_runs_a_trial_too(harbor: Path, tmp_path: Path, ledger: Ledger) -> None:
    """Protects: ``--ek driver=gvisor``: the trial runs in a runsc sandbox instead of a VM, with
    the same reward, record and confirmed absence."""
    if shutil.which("runsc") is None:
        pytest.skip("runsc is not installed (make setup installs it)")
    before = set(_runs(ledger))
    trials, store = _run(harbor, tmp_path, _task(tmp_path), 1, driver="gvisor")
    assert [_reward(t) for t in trials] == [1.0], trials
    _check_cleanroom(ledger, store, before, trials, 1.0, GvisorDriver())
    [run_id] = sorted(set(_runs(ledger)) - before)
    assert ledger.get_run(run_id).driver == "gvisor"  # type: ignore[union-attr]


def _multi_step(task: Path) -> Path:
    """``task`` made a two-step task: step ``one`` is the greeting (reward 1), step ``two``
    writes ``reward.json`` with a reward of 0.5; Harbor's trial reward is their mean."""
    with (task / "task.toml").open("a") as f:
        f.write('\n[[steps]]\nname = "one"\n\n[[steps]]\nname = "two"\n')
    for name in ("one", "two"):
        step = task / "steps" / name
        (step / "tests").mkdir(parents=True)
        shutil.copytree(task / "solution", step / "solution")
        shutil.copy(task / "instruction.md", step / "instruction.md")
    shutil.copy(task / "tests" / "test.sh", task / "steps" / "one" / "tests" / "test.sh")
    (task / "steps" / "two" / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        "echo '{\"reward\": 0.5}' > /logs/verifier/reward.json\n"
    )
    return task


def test_a_multi_step_trial_is_recorded_with_the_reward_harbor_saw(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects issue 36: a multi-step task scored by Harbor (the mean of its steps' rewards,
    1 and 0.5) was ``episode_error`` in our record (no trial-level reward file): the session
    now finishes with Harbor's reward, each step's in the record's info."""
    before = set(_runs(ledger))
    trials, store = _run(harbor, tmp_path, _multi_step(_task(tmp_path)), 1)
    [trial] = trials
    assert _reward(trial) == 0.75 and trial.get("exception_info") is None, trial
    _check_cleanroom(ledger, store, before, trials, 0.75)
    [run_id] = sorted(set(_runs(ledger)) - before)
    [row] = ledger.episodes(run_id)
    record = LocalStore(store).get_record(run_id, row.episode_id)
    assert record is not None
    assert record["info"]["step_rewards"] == {"one": {"reward": 1.0}, "two": {"reward": 0.5}}


def test_a_broken_solution_gets_reward_zero(harbor: Path, tmp_path: Path, ledger: Ledger) -> None:
    """Protects: the reward is the guest's verdict, not a constant: a solution that writes the
    wrong greeting gets 0 from Harbor's verifier, and the cleanroom record says 0 too."""
    before = set(_runs(ledger))
    task = _task(tmp_path, "mkdir -p /app && echo goodbye > /app/greeting.txt")
    trials, store = _run(harbor, tmp_path, task, 1)
    assert [_reward(t) for t in trials] == [0.0], trials
    _check_cleanroom(ledger, store, before, trials, 0.0)


def test_a_trial_cancelled_in_the_agent_step_leaves_no_vm(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects: SIGTERM (Harbor's Ctrl-C) while the agent's command runs in the VM: Harbor
    cancels the trial, the
    provider's ``stop`` ends the session ``cancelled`` (its transcript kept with the attempt)
    and the VM is destroyed and confirmed absent before ``harbor`` exits."""
    before = set(_runs(ledger))
    task = _task(tmp_path, "touch /tmp/solving; sleep 600")
    jobs, store = tmp_path / "jobs", tmp_path / "store"
    proc = subprocess.Popen(
        _command(harbor, task, jobs, store, 1),
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_id = _wait_for_agent_step(ledger, before, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    [row] = ledger.episodes(run_id)
    assert row.outcome == "cancelled", (row, out[-4000:])
    assert_nothing_left(QemuDriver(), ledger, run_id, LocalStore(store))
    transcript = LocalStore(store).episode_uri(run_id, row.episode_id).removeprefix("file://")
    kept = Path(transcript) / "attempts" / str(row.attempt) / "logs" / "transcript.jsonl"
    assert "chmod +x /solution/solve.sh" in kept.read_text()


def _wait_for_agent_step(ledger: Ledger, before: set[str], proc: subprocess.Popen[str]) -> str:
    """The run of the one trial, once its VM runs the oracle's ``solve.sh`` (the command after
    ``chmod +x``: a command enters the transcript when it ends)."""
    from cleanroom.host import paths

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        runs = sorted(set(_runs(ledger)) - before)
        for run_id in runs:
            for transcript in (paths.home() / "staging").glob(f"**/{run_id}/**/transcript.jsonl"):
                if "chmod +x /solution/solve.sh" in transcript.read_text():
                    time.sleep(3)  # the next command is solve.sh: well inside its sleep
                    return run_id
        time.sleep(0.5)
    raise AssertionError("the trial never reached its agent step")


def test_the_agent_runs_as_the_tasks_user(harbor: Path, tmp_path: Path, ledger: Ledger) -> None:
    """Protects: ``exec(user=...)``: the task's ``[agent] user`` runs the oracle's commands as
    that user in the guest (not as the guest agent's root), the verifier as root."""
    before = set(_runs(ledger))
    task = _task(
        tmp_path,
        solve="id -un > /tmp/who",
        test='[ "$(cat /tmp/who)" = nobody ] && [ "$(id -u)" = 0 ] && r=1 || r=0\n'
        "echo $r > /logs/verifier/reward.txt",
        agent='user = "nobody"',
    )
    trials, store = _run(harbor, tmp_path, task, 1)
    assert [_reward(t) for t in trials] == [1.0], trials
    _check_cleanroom(ledger, store, before, trials, 1.0)


def _refused(harbor: Path, tmp_path: Path, task: Path, **how: Any) -> dict[str, object]:
    """The one trial of ``task``, which must have failed before any VM was created."""
    trials, _ = _run(harbor, tmp_path, task, 1, **how)
    [trial] = trials
    assert trial.get("exception_info"), trial
    return trial["exception_info"]  # type: ignore[return-value]


def test_public_network_is_refused_before_any_vm(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects: Harbor's ``public`` mode is refused with a message saying what to set (a
    provider must enforce the policy or reject the task), and only its own trial fails (issue
    36: the refusal, raised while Harbor planned the job, ended the whole job): the job runs to
    its end, the trial's exception names the fix, and no cleanroom run was opened."""
    before = set(_runs(ledger))
    info = _refused(harbor, tmp_path, _task(tmp_path, network='network_mode = "public"'))
    message = " ".join(str(info["exception_message"]).split())
    assert "network_mode = 'no-network'" in message, info
    assert set(_runs(ledger)) == before


def test_a_refused_task_fails_only_its_trial_and_the_dataset_runs_on(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects issue 36: a dataset of a ``public`` task and a good one, run as one job: the
    refused task's trial fails with the reason, the other still runs to reward 1 in its VM
    (before, the refusal ended the job and no trial after it ran)."""
    before = set(_runs(ledger))
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    shutil.move(_task(tmp_path / "a", network='network_mode = "public"'), dataset / "a-public")
    shutil.move(_task(tmp_path / "b"), dataset / "b-good")
    trials, store = _run(harbor, tmp_path, dataset, 1, expect=2)
    by_task = {str(t["task_name"]): t for t in trials}
    refused, good = by_task["a-public"], by_task["b-good"]
    assert "no-network" in str((refused.get("exception_info") or {}).get("exception_message"))
    assert _reward(good) == 1.0 and good.get("exception_info") is None, good
    _check_cleanroom(ledger, store, before, [good], 1.0)


def test_public_allowed_on_purpose_becomes_the_operators_allowlist(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects the operator's switch for ``public`` (``--ek public_as=HOST,...``): the task is
    no longer refused for its mode; its session gets that allowlist through the egress
    machinery, which here refuses a host the baseline's ``network.allow`` does not cover, by
    name (an intent, no VM): the switch reaches the same checks as an ``allowlist`` task."""
    before = set(_runs(ledger))
    task = _task(tmp_path, network='network_mode = "public"')
    info = _refused(harbor, tmp_path, task, ek=("public_as=example.com",))
    message = str(info["exception_message"])
    assert "example.com:443" in message and "no-network" not in message, info
    [run_id] = sorted(set(_runs(ledger)) - before)
    assert [e.created_at for e in ledger.envs(run_id=run_id)] == [None]


def test_an_allowlist_beyond_the_baselines_is_refused_before_any_vm(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects: Harbor's allowlist reaches cleanroom's egress policy (each host on 443 and 80):
    a host the baseline's ``network.allow`` does not cover is refused by name, no VM created."""
    before = set(_runs(ledger))
    task = _task(tmp_path, network='network_mode = "allowlist"\nallowed_hosts = ["example.com"]')
    info = _refused(harbor, tmp_path, task)
    assert "example.com:443" in str(info["exception_message"]), info
    [run_id] = sorted(set(_runs(ledger)) - before)
    assert [e.created_at for e in ledger.envs(run_id=run_id)] == [None]  # an intent, no VM


@pytest.mark.parametrize("source", ["docker_image", "dockerfile"])
def test_an_image_task_runs_from_a_loopback_registry(
    harbor: Path, tmp_path: Path, ledger: Ledger, registry: str, source: str
) -> None:
    """Protects: a task with no ``cleanroom.toml`` but a ``docker_image``, or an
    ``environment/Dockerfile`` built FROM it (both on a real registry on 127.0.0.1), gets its
    baseline from there (the Dockerfile's RUN is seen by the solution), the oracle's reward
    comes back, and the task folder is only read (the spec is written in the cleanroom home)."""
    ref = _publish(tmp_path, registry, "harbor-debian", [], {"Env": ["PATH=/usr/bin:/bin"]})
    before = set(_runs(ledger))
    if source == "docker_image":
        task = _task(tmp_path, environment=f'docker_image = "{ref}"')
    else:
        solve = (
            "[ -f /opt/built ] && mkdir -p /app && echo hello from cleanroom > /app/greeting.txt"
        )
        task = _task(tmp_path, solve=solve)
        (task / "environment" / "Dockerfile").write_text(f"FROM {ref}\nRUN touch /opt/built\n")
    (task / "environment" / "cleanroom.toml").unlink()
    files = sorted(task.rglob("*"))
    trials, store = _run(harbor, tmp_path, task, 1, offline=False)  # the registry is on lo
    assert [_reward(t) for t in trials] == [1.0], trials
    _check_cleanroom(ledger, store, before, trials, 1.0)
    assert sorted(task.rglob("*")) == files


def _publish(
    tmp_path: Path, registry: str, name: str, layers: list[bytes], config: dict[str, Any]
) -> str:
    """A Debian image (this host's debootstrap tarball, then ``layers``) with ``config``,
    pushed to the loopback registry: its reference."""
    needs_root_tools()
    if shutil.which("skopeo") is None or shutil.which("buildah") is None:
        pytest.skip("skopeo/buildah not installed (scripts/setup.sh installs them)")
    debian = debootstrap_tarball(BaseSection()).read_bytes()
    image = layout(tmp_path / name, [debian, *layers], config)
    ref = f"{registry}/tests/{name}:1"
    subprocess.run(
        [
            *("skopeo", "copy", "--quiet", "--dest-tls-verify=false"),
            *(f"oci:{image}:latest", f"docker://{ref}"),
        ],
        check=True,
    )
    return ref


def test_an_images_entrypoint_starts_a_service_as_docker_would(
    harbor: Path, tmp_path: Path, ledger: Ledger, registry: str
) -> None:
    """Protects: an image whose ``Entrypoint`` starts a service (then execs its arguments)
    has it started before Harbor's healthcheck, as Harbor's Docker environment starts the
    container (``ENTRYPOINT sh -c 'sleep infinity'``): the task's healthcheck passes, the
    solution sees the service's mark, the arguments it was given and the keepalive running,
    and the reward is 1."""
    start = b'#!/bin/sh\necho "$*" > /tmp/service-args\ntouch /tmp/service-started\nexec "$@"\n'
    service = layer_bytes([Entry("usr/local/bin/start-service", data=start, mode=0o755)])
    config = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Entrypoint": ["start-service"]}
    ref = _publish(tmp_path, registry, "harbor-service", [service], config)
    before = set(_runs(ledger))
    solve = (
        "[ -f /tmp/service-started ]"
        ' && [ "$(cat /tmp/service-args)" = "sh -c sleep infinity" ]'
        " && grep -qs 'sleep [i]nfinity' /proc/[0-9]*/cmdline"
        " && mkdir -p /app && echo hello from cleanroom > /app/greeting.txt"
    )
    task = _task(tmp_path, solve=solve, environment=f'docker_image = "{ref}"')
    (task / "environment" / "cleanroom.toml").unlink()
    with (task / "task.toml").open("a") as f:
        f.write(
            '\n[environment.healthcheck]\ncommand = "test -f /tmp/service-started"\n'
            "interval_sec = 1.0\nretries = 2\n"
        )
    trials, store = _run(harbor, tmp_path, task, 1, offline=False)  # the registry is on lo
    assert [_reward(t) for t in trials] == [1.0], trials
    _check_cleanroom(ledger, store, before, trials, 1.0)


def test_files_larger_than_a_frame_travel_whole(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects: transfers past the guest agent's 1 MiB frame: a 3 MiB file in the solution
    folder reaches the guest intact (``upload_dir`` in parts), and the verifier's copy of it
    comes back intact into Harbor's trial folder (``download_dir``)."""
    blob = os.urandom(3 * 1024 * 1024 + 5)
    digest = hashlib.sha256(blob).hexdigest()
    task = _task(
        tmp_path,
        solve="mkdir -p /app && echo hello from cleanroom > /app/greeting.txt\n"
        "cp /solution/blob.bin /app/blob.bin",
        test=f'[ "$(sha256sum < /app/blob.bin)" = "{digest}  -" ] && r=1 || r=0\n'
        "cp /app/blob.bin /logs/verifier/blob.bin; echo $r > /logs/verifier/reward.txt",
    )
    (task / "solution" / "blob.bin").write_bytes(blob)
    before = set(_runs(ledger))
    trials, store = _run(harbor, tmp_path, task, 1)
    assert [_reward(t) for t in trials] == [1.0], trials
    [back] = (tmp_path / "jobs").glob("*/*/verifier/blob.bin")
    assert hashlib.sha256(back.read_bytes()).hexdigest() == digest
    _check_cleanroom(ledger, store, before, trials, 1.0)


def test_a_task_with_nothing_to_build_from_is_refused_by_name(
    harbor: Path, tmp_path: Path, ledger: Ledger
) -> None:
    """Protects: a task with no ``cleanroom.toml``, ``docker_image`` or Dockerfile is refused
    naming its environment folder and what it lacks, and no cleanroom run starts."""
    before = set(_runs(ledger))
    task = _task(tmp_path)
    (task / "environment" / "cleanroom.toml").unlink()
    done = _harbor(harbor, tmp_path, task, 1)
    trials = _trials(tmp_path / "jobs")
    said = " ".join((done.stdout + done.stderr).split()) + json.dumps(trials)
    lacks = f"{task / 'environment'}: no cleanroom.toml, docker_image or Dockerfile"
    assert lacks in said, said[-4000:]
    assert set(_runs(ledger)) == before


HELPERS = """
import io, json, sys, tarfile, tempfile
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from cleanroom.integrations import harbor as h


def raised(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

allow = NetworkPolicy(
    network_mode=NetworkMode.ALLOWLIST,
    allowed_hosts=["api.example.com", "*.example.org", "10.0.0.0/8", "fd00::1"],
)
buffer = io.BytesIO()
with tarfile.open(fileobj=buffer, mode="w") as tar:
    sparse = tarfile.TarInfo("big.img")
    sparse.type = tarfile.GNUTYPE_SPARSE
    fine = tarfile.TarInfo("ok.txt")
    fine.size = 2
    tar.addfile(fine, io.BytesIO(b"ok"))
kept = [m.name for m in tarfile.open(fileobj=io.BytesIO(buffer.getvalue())) if
        h._guest_member(m, "/tmp") is not None]
print(json.dumps({
    "allowlist": h.egress_allowlist(allow),
    "none": h.egress_allowlist(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)),
    "uid": h._argv("id", 1000),
    "name": h._argv("id", "agent"),
    "root": h._argv("id", "root"),
    "sparse": h._guest_member(sparse, "/tmp") is None,
    "fake": str(raised(lambda: h._vm_driver("fake"))),
    "qemu": h._vm_driver("qemu"),
    "kept": kept,
    "spec": Path(h.baseline_spec_for(
        Path(tempfile.mkdtemp()),
        EnvironmentConfig(docker_image="127.0.0.1:5000/t/img:1", cpus=1.5, memory_mb=512),
        "My_Task",
    )).read_text(),
}))
"""


def test_the_providers_mappings(harbor: Path, tmp_path: Path) -> None:
    """Protects (in Harbor's Python, no VM): Harbor's allowlist entries become cleanroom's
    HOST:PORT on 443 and 80 (IPv6 in brackets), no-network is none; a user becomes
    runuser/setpriv; a guest's sparse tar member is skipped; the fake driver (host processes)
    is refused; a docker_image task's spec names
    the image with the task's cpus and memory, a lowercase name and the session limit."""
    done = subprocess.run(
        [str(harbor.parent / "python"), "-c", HELPERS],
        env={**os.environ, "CLEANROOM_HOME": str(tmp_path)},  # where the spec is written
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout)
    assert got["allowlist"] == [
        "api.example.com:443",
        "api.example.com:80",
        "*.example.org:443",
        "*.example.org:80",
        "10.0.0.0/8:443",
        "10.0.0.0/8:80",
        "[fd00::1]:443",
        "[fd00::1]:80",
    ]
    assert got["none"] == []
    assert got["uid"][:4] == ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    assert got["name"] == ["runuser", "-u", "agent", "--", "bash", "-c", "id"]
    assert got["root"] == ["bash", "-c", "id"]
    assert got["sparse"] and got["kept"] == ["ok.txt"]
    assert got["fake"].startswith("ConfigError: driver 'fake' runs commands on this host")
    assert got["qemu"] == "qemu"
    spec = got["spec"]
    assert 'image = "docker://127.0.0.1:5000/t/img:1"' in spec and 'name = "my_task"' in spec
    assert "vcpus = 2" in spec and "memory_mib = 512" in spec and "timeout_s = 14400" in spec

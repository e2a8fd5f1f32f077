"""``cleanroom doctor`` names what a host lacks, each gap with the command that fixes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cleanroom.checks.doctor import Host, diagnose


def bare(tmp_path: Path, **kw: object) -> Host:
    """A host with nothing installed, no cgroups, no KVM."""
    (tmp_path / "cg").mkdir(exist_ok=True)
    args: dict[str, object] = {
        "which": lambda name: None,
        "cgroup_root": tmp_path / "cg",
        "kvm": lambda: False,
        "home": lambda: tmp_path / "home",
        "sandbox": lambda: "no user namespaces",
    }
    return Host(**{**args, **kw})  # type: ignore[arg-type]


def test_a_bare_host_gets_a_fix_for_every_gap(tmp_path: Path) -> None:
    found = {f.part: f for f in diagnose(bare(tmp_path))}
    assert list(found) == [
        "qemu",
        "kvm",
        "runsc",
        "cgroups",
        "builder",
        "sandbox",
        "disk",
        "home",
    ]
    assert found["sandbox"].status == "fail"
    assert "no user namespaces" in found["sandbox"].detail
    assert found["qemu"].status == "fail" and "apt-get install qemu-system-x86" in str(
        found["qemu"].fix
    )
    assert found["builder"].status == "fail"
    assert "erofs-utils" in str(found["builder"].fix) and "mmdebstrap" in str(found["builder"].fix)
    assert found["kvm"].status == "warn" and "TCG will be used" in found["kvm"].detail
    assert found["runsc"].status == "warn" and "apt-get install runsc" in str(found["runsc"].fix)
    assert found["cgroups"].status == "warn"
    assert all(f.fix for f in found.values() if f.status != "ok")
    assert found["home"].status == "ok" and "does not exist yet" in found["home"].detail


def test_cgroup_layouts_and_kvm_verdicts_are_told_apart(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    hybrid = tmp_path / "hybrid"
    for name in ("memory", "pids", "unified"):
        (hybrid / name).mkdir(parents=True)
    (hybrid / "unified" / "cgroup.procs").write_text("")
    assert "cgroup v2" in diagnose(bare(tmp_path, cgroup_root=v2))[3].detail
    assert diagnose(bare(tmp_path, cgroup_root=hybrid))[3].detail.startswith("hybrid: v1 memory")
    assert diagnose(bare(tmp_path, kvm=lambda: True))[1].status == "ok"
    assert "not probed yet" in diagnose(bare(tmp_path, kvm=lambda: None))[1].detail


def test_a_home_others_can_write_or_someone_else_owns_fails(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)
    found = diagnose(bare(tmp_path))[-1]
    assert found.status == "fail" and found.fix == f"chmod go-w {home}"
    home.chmod(0o700)
    assert diagnose(bare(tmp_path))[-1].status == "ok"


def test_the_command_runs_on_this_host_and_once_stays_quiet_after_a_pass(tmp_path: Path) -> None:
    env = {**os.environ, "CLEANROOM_HOME": str(tmp_path / "home")}

    def doctor(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "cleanroom", "doctor", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)

    first = doctor("--once")
    assert first.returncode in (0, 1), first.stderr
    lines = [line.split()[:2] for line in first.stdout.splitlines() if not line.startswith(" ")]
    assert [part for _, part in lines] == [
        "qemu",
        "kvm",
        "runsc",
        "cgroups",
        "builder",
        "sandbox",
        "disk",
        "home",
    ]
    assert all(status in ("ok", "warn", "fail") for status, _ in lines)
    if first.returncode == 0:
        assert doctor("--once").stdout == ""  # passed once on this host: make demo stays quiet
        assert "qemu" in doctor().stdout  # without --once it always reports
    else:
        assert "doctor: missing" in first.stderr


def test_the_build_sandbox_is_probed_for_real_on_this_host(tmp_path: Path) -> None:
    """As root (how the suite runs the builder) the real probe runs ``true`` confined."""
    from cleanroom.checks.doctor import _sandbox_probe

    if os.geteuid() != 0:
        assert "not root" in str(_sandbox_probe())
    else:
        assert _sandbox_probe() is None

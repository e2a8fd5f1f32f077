"""``[agent] kind`` in a baseline spec, and what it changes in the build's inputs.

Protects: the default is the native agent, with no ``agent`` in the canonical spec (an explicit
``kind = "native"`` is the same spec and digest); ``kind = "python"`` (the removed Python agent) and
any other agent are refused at load time naming the spec file and ``agent.kind``; the digest covers
the C sources, and with a function entrypoint the warm worker it starts; a function entrypoint
in an image without Python is refused at build time, naming the entrypoint; a [network] allowlist
is accepted (the agent sets up the NIC).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cleanroom.agent import native
from cleanroom.baseline import spec as spec_module
from cleanroom.baseline.initramfs import NATIVE_LAUNCH, init_script
from cleanroom.baseline.rootfs import AGENT_BINARY, stage_agent
from cleanroom.baseline.spec import INIT_SCRIPT, load_spec, spec_digest
from cleanroom.errors import BuildError, SpecError

COMMAND = 'name = "n"\n[entrypoint]\ncommand = ["/bin/true"]\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "baseline.toml"
    path.write_text(text)
    return path


def test_the_default_agent_is_the_native_one_and_naming_it_changes_nothing(
    tmp_path: Path,
) -> None:
    spec = load_spec(write(tmp_path, COMMAND))
    assert spec.agent.kind == "native"
    assert "agent" not in spec.canonical()
    explicit = load_spec(write(tmp_path, COMMAND + '[agent]\nkind = "native"\n'))
    assert spec_digest(explicit) == spec_digest(spec)


def test_the_python_agent_is_refused_naming_the_spec_file_and_the_field(tmp_path: Path) -> None:
    """``kind = "python"`` is a SpecError, not a FutureWarning and a Python-agent build (as it
    was before the Python agent was removed)."""
    path = write(tmp_path, COMMAND + '[agent]\nkind = "python"\n')
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    message = str(caught.value)
    assert str(path) in message and "agent.kind" in message
    assert "Python guest agent was removed" in message


def test_a_native_spec_is_a_build_whose_digest_covers_the_c_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = load_spec(write(tmp_path, COMMAND))
    copy = tmp_path / "native"
    copy.mkdir()
    for name in native.files():
        (copy / name).write_bytes((native.NATIVE_DIR / name).read_bytes())
    (copy / "json.c").write_bytes((copy / "json.c").read_bytes() + b"/* changed */\n")
    before = spec_digest(spec)
    monkeypatch.setattr(spec_module.native, "NATIVE_DIR", copy)
    assert spec_digest(spec) != before


def test_the_init_hands_pid_1_to_the_agent_binary() -> None:
    script = init_script()
    assert script == INIT_SCRIPT.read_bytes()
    assert script.endswith(NATIVE_LAUNCH) and b"python3" not in script
    assert b"/opt/cleanroom/agent/agent" in NATIVE_LAUNCH


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ('[entrypoint]\ncommand = ["x"]\n[agent]\nkind = "rust"\n', "agent.kind"),
    ],
)
def test_what_the_native_agent_cannot_run_is_refused_naming_the_field(
    tmp_path: Path, extra: str, why: str
) -> None:
    with pytest.raises(SpecError, match=why):
        load_spec(write(tmp_path, 'name = "n"\n' + extra))


FUNCTION = 'name = "n"\n[entrypoint]\nfunction = "entry:run"\n'  # the default agent


def test_a_native_function_spec_loads_and_its_digest_covers_the_warm_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = load_spec(write(tmp_path, FUNCTION))
    assert spec.warm_config() is not None
    before = spec_digest(spec)
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    worker = spec_module.AGENT_DIR / "worker.py"
    (agent_dir / "worker.py").write_bytes(worker.read_bytes() + b"# changed\n")
    monkeypatch.setattr(spec_module, "AGENT_DIR", agent_dir)
    assert spec_digest(spec) != before


def test_a_function_entrypoint_in_an_image_without_python_is_a_build_error(
    tmp_path: Path,
) -> None:
    config = load_spec(write(tmp_path, FUNCTION)).warm_config()
    stage = tmp_path / "stage"
    with pytest.raises(BuildError, match="function 'entry:run' needs Python 3 in the image"):
        stage_agent(stage, config, gym=False, has_python=False)  # the sandbox found no python3
    assert not (stage / "cleanroom" / "entry.json").exists()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_with_python_in_the_image_the_worker_and_its_config_go_next_to_the_agent(
    tmp_path: Path,
) -> None:
    config = load_spec(write(tmp_path, FUNCTION)).warm_config()
    stage = tmp_path / "stage"
    stage_agent(stage, config, gym=False, has_python=True)
    agent = stage / "cleanroom" / "agent"  # /opt/cleanroom/agent, the binary installed last
    assert sorted(p.name for p in agent.iterdir()) == ["worker.py"]
    assert (stage / AGENT_BINARY).read_bytes()[:4] == b"\x7fELF"
    assert (agent / "worker.py").read_bytes() == (spec_module.AGENT_DIR / "worker.py").read_bytes()
    assert json.loads((agent.parent / "entry.json").read_text()) == config


def test_gvisor_starts_the_native_binary_for_a_native_baseline(tmp_path: Path) -> None:
    """The sandbox's PID 1 is the baseline's agent component; a baseline without one (built for
    the removed Python agent) is a LaunchError naming it, not python3 as PID 1."""
    import dataclasses

    from tests.conftest import make_fake_baseline

    from cleanroom.core.baseline_model import AGENT_FILE, Component
    from cleanroom.drivers import gvisor_bundle
    from cleanroom.errors import LaunchError

    python = make_fake_baseline(tmp_path)
    agent = Component(AGENT_FILE, 3, "ab" * 32)
    native_one = dataclasses.replace(python, components=(*python.components, agent))
    assert gvisor_bundle.agent_args(native_one) == ["/opt/cleanroom/agent/agent"]
    with pytest.raises(LaunchError, match=f"baseline {python.short}: built for the removed"):
        gvisor_bundle.agent_args(python)  # no agent component


def test_a_native_baselines_agent_sha256_is_its_agent_component(tmp_path: Path) -> None:
    """What export puts in provenance (``agent_sha256``), and ``check provenance`` shows."""
    import dataclasses

    from tests.conftest import make_fake_baseline

    from cleanroom.core.baseline_model import AGENT_FILE, Component
    from cleanroom.evidence import provenance

    python = make_fake_baseline(tmp_path)
    agent = Component(AGENT_FILE, 3, "ab" * 32)
    native_one = dataclasses.replace(python, components=(*python.components, agent))
    assert python.agent_sha256 is None and native_one.agent_sha256 == "ab" * 32
    record = {"provenance": {"agent_sha256": native_one.agent_sha256}}
    assert provenance.summary(record)["provenance.agent_sha256"] == "ab" * 32
    assert "provenance.agent_sha256" not in provenance.summary({"provenance": {}})


def test_a_native_spec_may_have_an_egress_allowlist(tmp_path: Path) -> None:
    text = COMMAND + '[network]\nallow = ["example.com:443"]\n[agent]\nkind = "native"\n'
    spec = load_spec(write(tmp_path, text))
    assert spec.network is not None

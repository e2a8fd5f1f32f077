"""baseline.toml validation and the spec digest (the build cache key)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cleanroom.baseline import spec as spec_module
from cleanroom.baseline.spec import load_spec, spec_digest
from cleanroom.errors import SpecError

GOOD = """
name = "demo"
[base]
packages = ["python3-numpy"]
[pip]
packages = ["tqdm==4.66.1"]
[[files]]
src = "env"
dest = "/opt/demo"
[[files]]
src = "run.sh"
dest = "/usr/local/bin/run-demo"
[entrypoint]
command = ["python3", "/opt/demo/main.py"]
[limits]
timeout_s = 60
memory_mib = 256
"""


def write_spec(folder: Path, text: str = GOOD) -> Path:
    (folder / "env" / "pkg").mkdir(parents=True, exist_ok=True)
    (folder / "env" / "main.py").write_text("print('hi')\n")
    (folder / "env" / "pkg" / "data.txt").write_text("data\n")
    (folder / "run.sh").write_text("#!/bin/sh\nexec python3 /opt/demo/main.py\n")
    (folder / "run.sh").chmod(0o755)
    path = folder / "baseline.toml"
    path.write_text(text)
    return path


def test_a_good_spec_loads_with_defaults(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    assert spec.name == "demo"
    assert spec.base.suite == "bookworm" and spec.base.variant == "minbase"
    assert "python3-minimal" in spec.base.all_packages()
    assert "python3-numpy" in spec.base.all_packages()
    assert list(spec.base.all_packages()) == sorted(spec.base.all_packages())
    assert spec.kernel.package == "linux-image-cloud-amd64"
    assert spec.limits.timeout_s == 60 and spec.limits.vcpus is None
    assert spec.folder == tmp_path.resolve()
    assert [src for src, _ in spec.sources()] == [tmp_path / "env", tmp_path / "run.sh"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (('name = "demo"', 'name = "Bad Name!"'), "name"),
        (('dest = "/opt/demo"', 'dest = "opt/demo"'), "files.0.dest"),
        (('dest = "/opt/demo"', 'dest = "/opt/../etc"'), "files.0.dest"),
        (('dest = "/opt/demo"', 'dest = "/run/cleanroom/x"'), "files.0.dest"),
        (('dest = "/opt/demo"', 'dest = "/opt/cleanroom/agent"'), "files.0.dest"),
        (('src = "env"', 'src = "missing"'), "files.0.src"),
        (("timeout_s = 60", "timeout_s = -1"), "limits.timeout_s"),
        (("memory_mib = 256", "memory_mib = 1"), "limits.memory_mib"),
        (('["python3-numpy"]', '["--allow-unauthenticated"]'), "base.packages"),
        (('["python3-numpy"]', '["a,b"]'), "base.packages"),
        (('["tqdm==4.66.1"]', '["--index-url=http://evil"]'), "pip.packages"),
        (('command = ["python3", "/opt/demo/main.py"]', "command = []"), "entrypoint.command"),
        (("[limits]", "[limits]\nbogus = 1"), "limits.bogus"),
        (('name = "demo"', 'name = "demo"\ncolour = "red"'), "colour"),
        (("[base]", '[base]\nvariant = "kitchen-sink"'), "base.variant"),
    ],
)
def test_errors_name_the_file_and_the_field(
    tmp_path: Path, change: tuple[str, str], field: str
) -> None:
    path = write_spec(tmp_path, GOOD.replace(*change))
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"{field}:" in message


def test_a_missing_entrypoint_is_named(tmp_path: Path) -> None:
    path = write_spec(tmp_path, 'name = "x"\n')
    with pytest.raises(SpecError, match=r"entrypoint: required"):
        load_spec(path)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(write_spec(tmp_path, "name = \n"))
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.toml")


def test_the_digest_is_stable_and_independent_of_the_folder(tmp_path: Path) -> None:
    first = spec_digest(load_spec(write_spec(tmp_path / "a")))
    assert first == spec_digest(load_spec(tmp_path / "a" / "baseline.toml"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert spec_digest(load_spec(tmp_path / "b" / "baseline.toml")) == first
    assert first.startswith("sha256:") and len(first) == 71


def test_the_digest_follows_every_copied_file(tmp_path: Path) -> None:
    path = write_spec(tmp_path)
    before = spec_digest(load_spec(path))
    (tmp_path / "env" / "pkg" / "data.txt").write_text("data!\n")
    changed = spec_digest(load_spec(path))
    assert changed != before
    (tmp_path / "env" / "pkg" / "new.txt").write_text("")
    added = spec_digest(load_spec(path))
    assert added != changed
    (tmp_path / "run.sh").chmod(0o644)
    assert spec_digest(load_spec(path)) != added  # the exec bit is part of the image


def test_the_digest_ignores_host_caches(tmp_path: Path) -> None:
    path = write_spec(tmp_path)
    before = spec_digest(load_spec(path))
    cache = tmp_path / "env" / "__pycache__"
    cache.mkdir()
    (cache / "main.cpython-311.pyc").write_bytes(b"junk")
    (tmp_path / "env" / "stray.pyc").write_bytes(b"junk")
    assert spec_digest(load_spec(path)) == before


def test_the_digest_follows_the_spec_text_agent_and_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_spec(tmp_path)
    before = spec_digest(load_spec(path))
    path.write_text(GOOD.replace("timeout_s = 60", "timeout_s = 61"))
    assert spec_digest(load_spec(path)) != before
    path.write_text(GOOD)
    assert spec_digest(load_spec(path)) == before

    agent = tmp_path / "agent"  # the native agent's sources (the default agent)
    agent.mkdir()
    for name in spec_module.native.files():
        shutil.copy(spec_module.native.NATIVE_DIR / name, agent / name)
    monkeypatch.setattr(spec_module.native, "NATIVE_DIR", agent)
    assert spec_digest(load_spec(path)) == before
    with (agent / "frame.c").open("a") as f:
        f.write("\n/* changed */\n")
    agent_changed = spec_digest(load_spec(path))
    assert agent_changed != before

    monkeypatch.setattr(spec_module, "BUILDER_VERSION", "test")
    assert spec_digest(load_spec(path)) != agent_changed


def test_the_tiny_test_spec_is_valid() -> None:
    tiny = Path(__file__).resolve().parents[1] / "baselines" / "tiny" / "baseline.toml"
    spec = load_spec(tiny)
    assert spec.name == "tiny"
    assert spec.entrypoint.command == ["python3", "/opt/tiny/entry.py"]
    assert spec.limits.timeout_s == 30 and spec.limits.memory_mib == 256


def test_a_network_allowlist_is_part_of_the_spec_only_when_set(tmp_path: Path) -> None:
    plain = load_spec(write_spec(tmp_path))
    assert plain.network is None and "network" not in plain.canonical()  # digests stay as they were
    assert set(plain.canonical()) == set(plain.model_dump(mode="json")) - {"network", "agent"}
    allow = '\n[network]\nallow = ["api.example.com:443", "*.svc.internal:8080"]\n'
    networked = load_spec(write_spec(tmp_path / "net", GOOD + allow))
    assert networked.canonical()["network"] == {
        "allow": ["api.example.com:443", "*.svc.internal:8080"]
    }
    assert spec_digest(networked) != spec_digest(plain)


def test_a_bad_allowlist_entry_is_named(tmp_path: Path) -> None:
    path = write_spec(tmp_path, GOOD + '\n[network]\nallow = ["ok.example:443", "nope"]\n')
    with pytest.raises(SpecError, match=r"network\.allow: .*allow\[1\] 'nope'"):
        load_spec(path)


def test_the_allowlist_is_covered_by_the_baseline_digest() -> None:
    from cleanroom.core.baseline_model import Baseline, Component, identity
    from cleanroom.core.limits import Limits
    from cleanroom.host.digests import digest_of

    parts = ((Component("vmlinux", 1, "0" * 64),), ("true",), Limits(), "6.1", "0.3.0", "sha256:x")
    plain = identity(*parts)
    assert "network" not in plain  # baselines without one keep their digests
    networked = identity(*parts, network=("a.test:443",))
    assert networked["network"] == ["a.test:443"] and digest_of(networked) != digest_of(plain)
    baseline = Baseline.from_json(
        Path("/x"), {**networked, "digest": digest_of(networked), "name": "n", "spec": {}}
    )
    assert baseline.network == ("a.test:443",)
    assert digest_of(baseline.identity()) == baseline.digest
    assert Baseline.from_json(Path("/x"), {**plain, "digest": "d", "spec": {}}).network is None


FUNCTION = 'function = "main:run"\npreimport = ["json", "email.utils"]'


def test_a_function_entrypoint_gives_the_warm_workers_config(tmp_path: Path) -> None:
    text = GOOD.replace('command = ["python3", "/opt/demo/main.py"]', FUNCTION)
    spec = load_spec(write_spec(tmp_path, text))
    assert spec.entrypoint.command is None and spec.entrypoint.function == "main:run"
    assert spec.warm_config() == {
        "function": "main:run",
        "preimport": ["json", "email.utils"],
        "path": ["/opt/demo", "/usr/local/bin"],  # a folder's dest; a single file's folder
    }
    assert spec.canonical()["entrypoint"] == {
        "function": "main:run",
        "preimport": ["json", "email.utils"],
    }
    command = load_spec(write_spec(tmp_path / "c"))
    assert spec_digest(spec) != spec_digest(command)


def test_a_command_spec_keeps_its_canonical_json(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    assert spec.canonical()["entrypoint"] == {"command": ["python3", "/opt/demo/main.py"]}
    assert spec.warm_config() is None
    text = GOOD.replace("[entrypoint]", "[entrypoint]\npreimport = []")
    assert load_spec(write_spec(tmp_path / "b", text)).canonical() == spec.canonical()


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        ('command = ["x"]\nfunction = "m:f"', "exactly one of command or function"),
        ("preimport = []", "exactly one of command or function"),
        ('command = ["x"]\npreimport = ["json"]', "preimport needs a function entrypoint"),
        ('function = "no_colon"', "entrypoint.function"),
        ('function = "m:f()"', "entrypoint.function"),
        ('function = "m:f"\npreimport = ["os; rm"]', "entrypoint.preimport"),
    ],
)
def test_bad_function_entrypoints_are_named(tmp_path: Path, entrypoint: str, message: str) -> None:
    text = GOOD.replace('command = ["python3", "/opt/demo/main.py"]', entrypoint)
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        load_spec(write_spec(tmp_path, text))


def test_the_warm_test_spec_is_valid() -> None:
    warm = Path(__file__).resolve().parents[1] / "baselines" / "warm" / "baseline.toml"
    spec = load_spec(warm)
    assert spec.warm_config() == {
        "function": "entry:run",
        "preimport": ["json", "random"],
        "path": ["/opt/warm"],
    }


def test_image_specs_validate_their_reference(tmp_path: Path) -> None:
    """An image base: a known scheme, an existing local file, no Debian packages on top; the
    image may stand in for the entrypoint. Debian specs keep their canonical form (digest)."""
    bad = write_spec(tmp_path, 'name = "x"\n[base]\nimage = "ftp://nope"\n')
    with pytest.raises(SpecError, match="an image is one of"):
        load_spec(bad)
    missing = write_spec(tmp_path, 'name = "x"\n[base]\nimage = "oci-archive:none.tar"\n')
    with pytest.raises(SpecError, match=r"base\.image: .*none\.tar does not exist"):
        load_spec(missing)
    (tmp_path / "img.tar").write_bytes(b"x")
    with_packages = 'name = "x"\n[base]\nimage = "oci-archive:img.tar"\npackages = ["curl"]\n'
    with pytest.raises(SpecError, match="packages cannot be added to an image"):
        load_spec(write_spec(tmp_path, with_packages))
    spec = load_spec(write_spec(tmp_path, 'name = "x"\n[base]\nimage = "oci-archive:img.tar"\n'))
    assert spec.entrypoint is None and spec.image_ref() == f"oci-archive:{tmp_path / 'img.tar'}"
    assert spec.canonical()["base"] == {"image": "oci-archive:img.tar"}
    before = spec_digest(spec)
    (tmp_path / "img.tar").write_bytes(b"y")
    assert spec_digest(load_spec(tmp_path / "baseline.toml")) != before  # archive bytes count
    debian = load_spec(write_spec(tmp_path, GOOD))
    assert "image" not in debian.canonical()["base"]

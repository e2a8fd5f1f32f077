"""The image config's ``User``: resolved from the image's own tables, applied by a real helper.

Protects: every ``docker run`` form of ``User`` (name, uid, name:group, uid:gid, mixed) becomes
the numbers the image's /etc/passwd and /etc/group say, with the supplementary groups docker
would give; a name the image lacks is a ``BuildError`` naming the image; root needs nothing; a
symlinked /etc/passwd is read inside the tree, never the host's. The compiled ``runas`` helper
really drops to those numbers, hands the guest root to the user and refuses bad arguments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cleanroom.baseline.image_user import resolve_user
from cleanroom.baseline.rootfs import compile_runas
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.run_as import RUNAS_PATH, RunAs
from cleanroom.errors import BuildError

PASSWD = """root:x:0:0:root:/root:/bin/sh
app:x:1000:1000:App:/home/app:/bin/sh
svc:x:1001:1001::/srv:/bin/sh
"""
GROUP = """root:x:0:
app:x:1000:
svc:x:1001:
tools:x:50:app,svc
audio:x:29:app
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(PASSWD)
    (tmp_path / "etc" / "group").write_text(GROUP)
    return tmp_path


@pytest.mark.parametrize(
    ("spec", "uid", "gid", "groups", "home"),
    [
        ("app", 1000, 1000, (1000, 29, 50), "/home/app"),
        ("1000", 1000, 1000, (1000, 29, 50), "/home/app"),
        ("app:tools", 1000, 50, (50,), "/home/app"),
        ("svc:1000", 1001, 1000, (1000,), "/srv"),
        ("1001:50", 1001, 50, (50,), "/srv"),
        ("4242", 4242, 0, (0,), "/"),  # a uid the image does not list: docker allows it
        ("4242:4243", 4242, 4243, (4243,), "/"),
        ("root:tools", 0, 50, (50,), "/root"),
    ],
)
def test_user_forms(tree: Path, spec: str, uid: int, gid: int, groups: tuple[int, ...], home: str):
    run_as = resolve_user(tree, spec, "oci-archive:img.tar")
    assert run_as == RunAs(spec, uid, gid, groups, home)


@pytest.mark.parametrize("spec", ["", "root", "0", "0:0", "root:root"])
def test_root_needs_no_helper(tree: Path, spec: str) -> None:
    assert resolve_user(tree, spec, "img") is None


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("ghost", "no user 'ghost' in its /etc/passwd"),
        ("app:nogroup", "no group 'nogroup' in its /etc/group"),
        (":tools", "names no user"),
    ],
)
def test_unknown_names_are_build_errors_naming_the_image(tree: Path, spec: str, match: str) -> None:
    with pytest.raises(BuildError, match=match) as info:
        resolve_user(tree, spec, "docker-archive:task17.tar")
    assert "image docker-archive:task17.tar" in str(info.value)


def test_an_image_without_passwd_takes_only_numbers(tmp_path: Path) -> None:
    """A distroless image may have no /etc at all: a uid works, a name cannot."""
    assert resolve_user(tmp_path, "65532:65532", "img") == RunAs(
        "65532:65532", 65532, 65532, (65532,), "/"
    )
    with pytest.raises(BuildError, match="no user 'nonroot'"):
        resolve_user(tmp_path, "nonroot", "img")


def test_a_symlinked_passwd_is_read_inside_the_tree(tmp_path: Path) -> None:
    """An absolute symlink in the image points into the image, not at the host's /etc."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "passwd").write_text("daemon:x:77:77::/d:/bin/sh\n")
    (tmp_path / "etc" / "passwd").symlink_to("/data/passwd")
    assert resolve_user(tmp_path, "daemon", "img") == RunAs("daemon", 77, 77, (77,), "/d")
    with pytest.raises(BuildError, match="no user 'root'"):  # the host's root is not seen
        resolve_user(tmp_path, "root:daemon", "img")


def test_wrap_and_baseline_record(tmp_path: Path) -> None:
    run_as = RunAs("app", 1000, 1000, (1000, 50), "/home/app")
    argv = run_as.wrap(["sh", "-c", "id"])
    assert argv == [RUNAS_PATH, "1000", "1000", "1000,50", "/run/cleanroom", "--", "sh", "-c", "id"]
    assert RunAs.from_json(run_as.to_json()) == run_as


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed (make setup installs it)")
    helper = tmp_path_factory.mktemp("runas") / RUNAS_PATH.lstrip("/")
    helper.parent.mkdir(parents=True)
    compile_runas(helper)
    return helper


def _run(helper: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helper), *args], capture_output=True, text=True, timeout=30)


def test_the_helper_drops_to_the_user_and_hands_over_the_guest_root(
    helper: Path, request: pytest.FixtureRequest
) -> None:
    """Run for real (as root): the command's ids are the ones asked for, and it can write
    result.json and out/ and read its secrets in the guest root it was handed."""
    if os.geteuid() != 0:
        pytest.skip("dropping to another uid needs root")
    public = Path(tempfile.mkdtemp(prefix="cleanroom-runas-", dir="/tmp"))  # tmp_path is 0700
    public.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(public))
    root = public / "run-cleanroom"
    (root / "out").mkdir(parents=True)
    (root / "secrets").mkdir(mode=0o700)
    (root / "secrets" / "TOKEN").write_text("s3cret")
    (root / "secrets" / "TOKEN").chmod(0o600)
    script = (
        f'echo "$(id -u) $(id -g) $(id -G)"; cat {root}/secrets/TOKEN; echo;'
        f"echo ok > {root}/result.json && echo art > {root}/out/a.txt"
    )
    proc = _run(helper, "4321", "4322", "4322,50", str(root), "--", "sh", "-c", script)
    assert proc.returncode == 0, proc.stderr
    ids, secret = proc.stdout.splitlines()[:2]
    assert ids == "4321 4322 4322 50" and secret == "s3cret"
    assert (root / "result.json").stat().st_uid == 4321
    assert (root / "out" / "a.txt").read_text() == "art\n"


def test_the_helper_refuses_what_it_cannot_do(helper: Path) -> None:
    assert _run(helper, "1000").returncode == 126
    assert _run(helper, "x", "1", "-", "-", "--", "true").returncode == 126
    assert _run(helper, "1", "1", "1,zz", "-", "--", "true").returncode == 126
    missing = _run(helper, "0", "0", "-", "-", "--", "/no/such/program")
    assert missing.returncode == 127 and "/no/such/program" in missing.stderr


def test_a_baseline_wraps_commands_only_when_its_image_names_a_user() -> None:
    """The entrypoint and session commands go through the helper, unless asked as root."""
    run_as = RunAs("app", 1000, 1000, (1000,), "/home/app")
    image = {"env": ["PATH=/bin"], "run_as": run_as.to_json()}
    with_user = Baseline.__new__(Baseline)
    object.__setattr__(with_user, "image", image)
    assert with_user.as_user(["true"]) == run_as.wrap(["true"])
    assert with_user.as_user(["true"], "root") == ["true"]
    assert with_user.image_env == {"PATH": "/bin", "HOME": "/home/app"}
    plain = Baseline.__new__(Baseline)
    object.__setattr__(plain, "image", {"env": ["HOME=/x"]})
    assert plain.as_user(["true"]) == ["true"] and plain.image_env == {"HOME": "/x"}


def test_any_passwd_group_and_user_resolve_or_fail_typed(tmp_path: Path) -> None:
    """An image's tables are untrusted input: any bytes there and any ``User`` give numbers in
    range or a ``BuildError``, never another exception."""
    hypothesis = pytest.importorskip("hypothesis", reason="hypothesis not installed (make setup)")
    st = hypothesis.strategies
    fields = st.text(alphabet="ab0123456789:,/\n#x-é²٣", max_size=40)
    (tmp_path / "etc").mkdir()

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(fields, fields, st.text(alphabet="ab0129:x²", max_size=12))
    def check(passwd: str, group: str, spec: str) -> None:
        (tmp_path / "etc" / "passwd").write_bytes(passwd.encode())
        (tmp_path / "etc" / "group").write_bytes(group.encode())
        try:
            run_as = resolve_user(tmp_path, spec, "img")
        except BuildError:
            return
        if run_as is not None:
            assert all(0 <= n < 2**32 - 1 for n in (run_as.uid, run_as.gid, *run_as.groups))
            assert run_as.groups[0] == run_as.gid

    check()

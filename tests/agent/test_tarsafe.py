"""Property tests (hypothesis) of the guest's tar unpacking (``agent/tarsafe.py``): for any
archive of files, folders and links with arbitrary names and link targets, ``extract`` either
refuses it (``Failed``) or leaves every created path inside the folder, with no link that
points out of it and nothing followed through a link. A corrupt archive is ``Failed`` too.
Protects issue 16 ("no path escapes, no device nodes")."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis not installed (make setup)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cleanroom.agent import tarsafe  # noqa: E402
from cleanroom.agent.handlers import Failed  # noqa: E402

PARTS = st.sampled_from(["a", "b", "..", ".", "", "l", "c d", "/", "\\", "\x01", "é"])
NAMES = st.lists(PARTS, min_size=1, max_size=5).map("/".join) | st.text(max_size=12)
KINDS = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE])


def archive(members: list[tuple[str, bytes, str]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, target in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = kind, target, 0o7777
            data = b"data" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def assert_inside(box: Path, dest: Path) -> None:
    real = dest.resolve()
    for path in box.rglob("*"):
        assert path == dest or path.is_relative_to(dest), path  # nothing beside dest
        if path.is_symlink():
            try:
                target = path.resolve(strict=True)
            except (OSError, RuntimeError):  # dangling, or a loop (realpath mangles those)
                target = Path(os.path.normpath(path.parent / os.readlink(path)))
            assert target == real or target.is_relative_to(real), (path, os.readlink(path))
        elif path.is_file():
            assert path.stat().st_mode & 0o7000 == 0, path  # no setuid, setgid, sticky


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(NAMES, KINDS, NAMES), max_size=6))
def test_any_archive_is_refused_or_stays_inside(
    tmp_path_factory: pytest.TempPathFactory, members: list[tuple[str, bytes, str]]
) -> None:
    box = tmp_path_factory.mktemp("box")
    dest = box / "dest"
    try:
        tarsafe.extract(io.BytesIO(archive(members)), str(dest))
    except Failed:
        pass
    except (UnicodeEncodeError, ValueError):  # tarfile could not even write such a name
        pass
    assert_inside(box, dest)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_are_refused_or_unpacked_inside(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        box = Path(tmp)
        with contextlib.suppress(Failed):
            tarsafe.extract(io.BytesIO(data), str(box / "dest"))
        assert_inside(box, box / "dest")


@pytest.mark.parametrize(
    ("rel", "target", "inside"),
    [("l", "a", True), ("d/l", "../a", True), ("l", "../a", False), ("d/l", "../../a", False),
     ("l", "/etc", False), ("l", "a/../../b", False), ("l", "", False), ("l", ".", True)],
)  # fmt: skip
def test_link_targets(rel: str, target: str, inside: bool) -> None:
    assert tarsafe.link_inside(rel, target) is inside

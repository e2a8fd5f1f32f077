"""Property test of the one new parser of guest input in sessions: the names ``find`` prints in
the guest for ``files.list`` / ``download_dir`` (``sessions.files._name``), and where
``_create`` puts a file named by one."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cleanroom.errors import SessionPathError, UnsafePath
from cleanroom.sessions.files import _create, _name

PARTS = st.sampled_from(["a", "..", ".", "", "b c", "\x00", "\\", "é", "x" * 300, "/", "\udcff"])
NAMES = st.one_of(
    st.binary(max_size=600),
    st.lists(PARTS, min_size=1, max_size=6).map(
        lambda ps: "/".join(ps).encode(errors="surrogateescape")
    ),
)


@settings(max_examples=400, deadline=None)
@given(NAMES)
def test_a_guest_name_is_relative_and_stays_inside(raw: bytes) -> None:
    """Protects: whatever bytes the guest prints as a name, ``_name`` returns a relative path
    without ``..``/``.``/empty parts or raises ``UnsafePath`` (a ProtocolError: the session
    ends), and a file created by that name lands under the caller's folder."""
    try:
        rel = _name(raw)
    except UnsafePath:
        return
    assert not rel.is_absolute() and all(p not in ("", ".", "..") for p in rel.parts)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "dest"
        root.mkdir()
        try:
            _create(root, rel.parts, b"x")
        except SessionPathError:
            return  # a name the host's filesystem refuses: no file, no escape
        written = [p for p in Path(tmp).rglob("*") if p.is_file()]
        assert written and all(p.resolve().is_relative_to(root.resolve()) for p in written)

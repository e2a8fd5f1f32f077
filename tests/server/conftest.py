"""A fake-driver ``cleanroom serve`` shared by a module's tests, and the SDK pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .kit import Server, new_key, stored_fake_baseline


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    baseline = stored_fake_baseline(tmp)
    args = ["--driver", "fake", "--template", f"fake={baseline.digest}", "--per-key", "3",
            "--max-body-mib", "4"]  # fmt: skip
    srv = Server(args, tmp / "serve.log")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture
def key(server: Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new API key, and the SDK's three environment variables set to use it."""
    k = new_key()
    for name, value in server.sdk_env(k).items():
        monkeypatch.setenv(name, value)
    return k

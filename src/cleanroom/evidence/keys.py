"""The ed25519 key that signs attestations: the home's own, or one the user passes.

The home's key is ``$CLEANROOM_HOME/keys/attest-ed25519.pem`` (PKCS#8, unencrypted), made on
first use in a 0700 folder as a 0600 file; two processes making it at once both end with the
one that was linked into place first. ``CLEANROOM_SIGNING_KEY`` (a PEM file) or an explicit
path replaces it. A key's id is the hex sha256 of its raw 32-byte public key, so a verifier
can say which key signed without trusting the envelope's word for it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from functools import cache
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cleanroom.errors import EvidenceError
from cleanroom.host import paths
from cleanroom.host.private import private_dir

KEY_ENV = "CLEANROOM_SIGNING_KEY"
HOME_KEY = "attest-ed25519.pem"


def home_key_path() -> Path:
    return paths.home() / "keys" / HOME_KEY


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _create(path: Path) -> None:
    """Write a new key at ``path`` unless one is there (a racing writer's wins)."""
    private_dir(path.parent)
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def load_private(path: Path) -> Ed25519PrivateKey:
    """An ed25519 private key from a PEM file; EvidenceError naming the file otherwise."""
    try:
        data = path.read_bytes()
        key = serialization.load_pem_private_key(data, password=None)
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise EvidenceError(f"cannot read the signing key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise EvidenceError(f"the signing key {path} is not an ed25519 key")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    """An ed25519 public key from a PEM file (or the public half of a private one)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EvidenceError(f"cannot read the public key {path}: {exc}") from exc
    if b"PRIVATE KEY" in data:
        return load_private(path).public_key()
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise EvidenceError(f"cannot read the public key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise EvidenceError(f"the public key {path} is not an ed25519 key")
    return key


def signing_key_path(explicit: Path | None = None) -> Path:
    """Which key signs: ``explicit``, else ``$CLEANROOM_SIGNING_KEY``, else the home's."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(KEY_ENV)
    return Path(env) if env else home_key_path()


@cache
def _cached(path: Path, stamp: tuple[int, int, int]) -> Ed25519PrivateKey:
    return load_private(path)


def signing_key(explicit: Path | None = None) -> Ed25519PrivateKey:
    """The key that signs (the home's is made on first use); cached while its file is unchanged."""
    path = signing_key_path(explicit)
    if path == home_key_path() and not path.exists():
        try:
            _create(path)
        except OSError as exc:
            raise EvidenceError(f"cannot make the signing key {path}: {exc}") from exc
    try:
        info = path.stat()
    except OSError as exc:
        raise EvidenceError(f"cannot read the signing key {path}: {exc}") from exc
    return _cached(path, (info.st_dev, info.st_ino, info.st_mtime_ns))

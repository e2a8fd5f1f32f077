"""``cleanroom serve --certfile/--keyfile``: the unmodified SDK, in its own process, over TLS
(a throwaway CA's certificate, the CA trusted through ``SSL_CERT_FILE``), and plain HTTP refused."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cleanroom.drivers.fake import FakeDriver

from .kit import Server, new_key, outcome, stored_fake_baseline

CLIENT = """
import sys
from e2b import Sandbox
sbx = Sandbox.create("fake")
assert sbx.commands.run("echo over-tls").stdout == "over-tls\\n"
sbx.files.write(sys.argv[1], "sealed")
assert sbx.files.read(sys.argv[1]) == "sealed"
print(sbx.sandbox_id)
sbx.kill()
"""


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None, signer: Any
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:  # the server's own: for 127.0.0.1 and localhost
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_pki(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA, and a server certificate it signed with its key (0600): their paths."""
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = _cert("cleanroom test CA", ca_key, None, ca_key)
    server = _cert("cleanroom serve", server_key, ca.subject, ca_key)
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_path, cert_path, key_path


def test_the_sdk_over_tls(tmp_path: Path) -> None:
    """Protects: with a certificate the server speaks TLS only; the SDK (sync, its own
    process and connection pool) creates, runs, moves files and kills over it; the sandbox
    ends ``completed`` with its env confirmed absent."""
    baseline = stored_fake_baseline(tmp_path)
    ca, cert, key = make_pki(tmp_path)
    args = ["--driver", "fake", "--template", f"fake={baseline.digest}",
            "--certfile", str(cert), "--keyfile", str(key)]  # fmt: skip
    srv = Server(args, tmp_path / "serve.log", ca=ca)
    try:
        with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)
        env = {**os.environ, **srv.sdk_env(new_key()), "SSL_CERT_FILE": str(ca)}
        done = subprocess.run(
            [sys.executable, "-c", CLIENT, str(tmp_path / "tls.txt")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        sid = done.stdout.split()[-1]
        assert outcome(sid, FakeDriver()) == "completed"
        assert (tmp_path / "tls.txt").read_text() == "sealed"
    finally:
        assert srv.stop() == 0, srv.log.read_text()

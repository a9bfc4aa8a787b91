"""Fixtures of the doctor's tests: run ``prefect-coder doctor`` in process (the real
command through typer, real sockets to a real emulator), a PREFECT_HOME of the test's
own (the default state store lives there), and a self-signed certificate."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from .helpers import Run


@pytest.fixture
def doctor(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    """``doctor(*args, env=...)`` runs the command with exactly ``env`` as its
    environment (CODER_* and the token variable), every log record captured at DEBUG,
    and PREFECT_HOME in the test's own directory."""
    from prefect.settings import PREFECT_HOME, temporary_settings

    from prefect_coder.cli import app

    def run(*args: str, env: Mapping[str, str]) -> Run:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            result = CliRunner().invoke(
                app, ["doctor", *args], env=dict(env), catch_exceptions=False
            )
        logs = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
        return Run(result.exit_code, result.output, logs)

    with temporary_settings(updates={PREFECT_HOME: tmp_path / "prefect-home"}):
        yield run


@pytest.fixture(scope="session")
def self_signed_tls(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    """A server-side SSLContext with a fresh self-signed certificate for 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    d = tmp_path_factory.mktemp("doctor-tls")
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    return ctx

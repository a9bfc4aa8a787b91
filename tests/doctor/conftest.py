"""Fixtures of the doctor's tests: run ``prefect-coder doctor`` in process (the real
command through typer, real sockets to a real emulator), a PREFECT_HOME of the test's
own (the default state store lives there), and a self-signed certificate."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from support.tls import self_signed_server_context
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
    return self_signed_server_context(tmp_path_factory.mktemp("doctor-tls"))

"""Each injected fault is named on its own FAIL line with its fix, the doctor exits 1,
and no output or log record holds any piece of the token (the wrong one included).

Faults come from the emulator's fault API (a 5xx, a removed route), from the
deployment's own answers (a wrong token, a wrong organization), from a closed port and
from a certificate nobody trusts."""

from __future__ import annotations

import socket
import ssl
import uuid
from typing import Any

import pytest

from coder_chat.emulator import Emulator

from .helpers import TOKEN, Run, assert_no_secret, coder_env

WRONG_TOKEN = "wk-3Hs8QpLx2Vn6Tz9RcM4dFj"


def failed(run: Run, name: str, *found_and_fix: str) -> str:
    """Assert the run failed on ``name`` (and only there) with every text in its line."""
    assert run.exit_code == 1, run.output
    line = run.line(name)
    assert line.startswith(f"FAIL  {name}"), line
    for text in found_and_fix:
        assert text in line, f"{text!r} not in {line!r}"
    fails = [ln for ln in run.output.splitlines() if ln.startswith("FAIL  ")]
    assert fails == [line], run.output
    for secret in (TOKEN, WRONG_TOKEN):
        assert_no_secret(run.output + run.logs, secret)
    return line


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_wrong_token(chatd_emulator: Emulator, doctor: Any) -> None:
    run = doctor(env=coder_env(chatd_emulator, token=WRONG_TOKEN))
    failed(
        run,
        "token",
        "rejected: GET /api/v2/users/me → 401",
        "API key is invalid.",
        "create one with `coder tokens create` and store it in $CODER_SESSION_TOKEN",
    )
    assert "build" not in run.output  # nothing past a rejected token is guessed at
    assert chatd_emulator.chats() == []


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_token_from_another_variable(chatd_emulator: Emulator, doctor: Any) -> None:
    env = {**coder_env(chatd_emulator), "CODER_SESSION_TOKEN": "", "MY_CODER_TOKEN": TOKEN}
    run = doctor("--token-env", "MY_CODER_TOKEN", env=env)
    assert run.exit_code == 0, run.output
    assert "$MY_CODER_TOKEN" in run.line("credentials")
    missing = doctor("--token-env", "NO_SUCH_VAR", env=env)
    failed(missing, "credentials", "token: $NO_SUCH_VAR is not set or empty", "--token-env")


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_wrong_missing_and_malformed_organization(chatd_emulator: Emulator, doctor: Any) -> None:
    other = str(uuid.uuid4())
    run = doctor(env=coder_env(chatd_emulator, CODER_ORG_ID=other))
    failed(
        run,
        "organization",
        f"organization_id: {other} is not one of the organizations of user admin",
        chatd_emulator.organization_id,
        "set --org-id (or CODER_ORG_ID) to one of them",
    )
    assert "models" not in run.output  # a wrong org's 404 says nothing about models
    run = doctor(env=coder_env(chatd_emulator, CODER_ORG_ID=""))
    failed(run, "organization", "organization_id: not set", "set --org-id (or CODER_ORG_ID)")
    run = doctor("--org-id", "acme", env=coder_env(chatd_emulator))
    failed(run, "organization", "organization_id: 'acme' is not a UUID")
    assert chatd_emulator.chats() == []  # no chat is created in an unchecked organization


def test_unreachable_closed_port(doctor: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The port is closed again: nothing listens there.
    env = {
        "CODER_URL": f"http://127.0.0.1:{port}",
        "CODER_SESSION_TOKEN": TOKEN,
        "CODER_ORG_ID": str(uuid.uuid4()),
    }
    run = doctor(env=env)
    failed(
        run,
        "server",
        f"http://127.0.0.1:{port} unreachable",
        "connection refused",
        f"nothing listens at http://127.0.0.1:{port}: check --base-url (or CODER_URL)",
    )
    assert "token" not in [ln[6:].split(" ", 1)[0] for ln in run.output.splitlines()]


def test_unresolvable_host(doctor: Any) -> None:
    """``.invalid`` never resolves (RFC 6761): the DNS failure is named, with its fix."""
    env = {
        "CODER_URL": "https://coder.doctor-check.invalid",
        "CODER_SESSION_TOKEN": TOKEN,
        "CODER_ORG_ID": str(uuid.uuid4()),
    }
    run = doctor(env=env)
    failed(
        run,
        "server",
        "https://coder.doctor-check.invalid unreachable",
        "name not resolved",
        "the host name 'coder.doctor-check.invalid' does not resolve here",
    )


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_server_error_5xx(chatd_emulator: Emulator, doctor: Any) -> None:
    chatd_emulator.faults.fail_rest(100, status=503, method="GET", path="/api/v2/chats")
    run = doctor(env=coder_env(chatd_emulator))
    failed(
        run,
        "build",
        "server error: GET /api/v2/chats?limit=1 → 503 Service Unavailable",
        "the Coder server (or a proxy in front of it) is failing: check coderd's logs",
    )
    chatd_emulator.faults.clear()
    # chatd's own 503 when the AI Gateway is off names that fix instead.
    gateway = "AI Gateway must be enabled for Coder Agents functionality."
    chatd_emulator.faults.fail_rest(1, status=503, method="POST", message=gateway)
    run = doctor(env=coder_env(chatd_emulator))
    failed(run, "chat-routes", gateway, "enable the AI Gateway (Coder Agents) on the deployment")


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_stream_upgrade_refused_5xx(chatd_emulator: Emulator, doctor: Any) -> None:
    """A proxy that answers the WebSocket upgrade with 502 (REST works)."""
    chatd_emulator.faults.refuse_upgrades(502)
    run = doctor(env=coder_env(chatd_emulator))
    failed(
        run,
        "stream",
        "stream dial failed: GET /api/v2/chats/",
        "/stream → 502 Bad Gateway",
        "let WebSocket upgrades (Upgrade/Connection headers) through every proxy",
    )


@pytest.mark.chatd_emulator(tokens=[TOKEN], era="b2")
def test_archive_refused_5xx(chatd_emulator: Emulator, doctor: Any) -> None:
    """The archive (PATCH) fails: the doctor chat would stay live, and so would every
    workflow's chat: a failure, naming the chat to archive by hand."""
    chatd_emulator.faults.fail_rest(100, status=500, method="PATCH")
    run = doctor(env=coder_env(chatd_emulator))
    chat_id = chatd_emulator.chats()[0]["id"]
    failed(
        run,
        "cleanup",
        f"doctor chat {chat_id} could not be archived",
        "PATCH /api/v2/chats/",
        "(500): Internal Server Error",
        "workflows archive their chats the same way",
        "archive it in the Coder UI (label prefect-coder/doctor)",
    )
    assert run.line("chat-routes").startswith("OK ")


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_missing_stream_route(chatd_emulator: Emulator, doctor: Any) -> None:
    chatd_emulator.faults.remove_route("/stream")
    run = doctor(env=coder_env(chatd_emulator))
    line = failed(
        run,
        "stream",
        "stream route missing: GET /api/v2/chats/",
        "/stream → 404 Route not found.",
        "upgrade Coder to a release whose chat API is build B1 (004053e8) or later",
        "let it pass WebSocket upgrades",
    )
    assert line
    # The route-check chat is archived even though its stream could not be read.
    assert [c["archived"] for c in chatd_emulator.chats()] == [True]


@pytest.mark.chatd_emulator(tokens=[TOKEN], era="b1")
def test_missing_create_route(chatd_emulator: Emulator, doctor: Any) -> None:
    chatd_emulator.faults.remove_route("/chats", method="POST")
    run = doctor(env=coder_env(chatd_emulator))
    failed(
        run,
        "chat-routes",
        "create (POST /chats) route missing: POST /api/v2/chats → 404 Route not found.",
        "upgrade Coder",
    )


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_no_chat_api_at_all(chatd_emulator: Emulator, doctor: Any) -> None:
    chatd_emulator.faults.remove_route("/api/v2/chats")
    chatd_emulator.faults.remove_route("/api/experimental/chats")
    run = doctor(env=coder_env(chatd_emulator))
    failed(
        run,
        "build",
        "no chat API: GET /api/v2/chats?limit=1 → 404 Route not found.",
        "GET /api/experimental/chats?limit=1 → 404",
        "upgrade Coder to a release whose chat API is build B1 (004053e8) or later, with "
        "Coder Agents enabled",
    )


@pytest.mark.chatd_emulator(tokens=[TOKEN], era="b1")
def test_older_than_b1(chatd_emulator: Emulator, doctor: Any) -> None:
    """A build with chats only under /api/experimental (before the v2 mount)."""
    chatd_emulator.faults.remove_route("/api/v2/chats")
    run = doctor(env=coder_env(chatd_emulator))
    failed(run, "build", "an older build than B1: chats only on /api/experimental", "upgrade")


def test_untrusted_certificate(self_signed_tls: ssl.SSLContext, doctor: Any) -> None:
    with Emulator.running_in_thread(tokens=[TOKEN], tls=self_signed_tls) as emu:
        assert emu.base_url.startswith("https://")
        run = doctor(env=coder_env(emu))
        failed(
            run,
            "server",
            f"{emu.base_url} certificate not trusted",
            "TLS failure (self-signed certificate)",
            "give this machine the CA that signed it (SSL_CERT_FILE=/path/to/ca.pem)",
            "--insecure (or CODER_VERIFY_TLS)",
        )
        # Verification off (test servers only): every check passes over https and wss,
        # and the server line warns.
        run = doctor("--insecure", env=coder_env(emu))
        assert run.exit_code == 0, run.output
        assert run.line("server").startswith("WARN  server")
        assert "TLS certificate NOT verified" in run.line("server")
        assert run.line("stream").startswith("OK    stream")
        assert_no_secret(run.output + run.logs, TOKEN)


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_prefect_api_unreachable(chatd_emulator: Emulator, doctor: Any) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        run = doctor(env=coder_env(chatd_emulator))
    failed(
        run,
        "prefect-api",
        f"http://127.0.0.1:{port}/api does not answer",
        "start the Prefect server or fix PREFECT_API_URL",
    )
    assert "automations" not in run.output  # nothing to read them from

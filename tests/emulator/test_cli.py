"""The ``coder-chat-emulator`` CLI: output contract and clean shutdown."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from coder_chat.emulator.cli import main
from coder_chat.emulator.eras import default_era


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_prints_url_first_and_stops_cleanly(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coder_chat.emulator.cli",
            "--token",
            "t1",
            "--token",
            "t2",
            "--era",
            "b1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        assert first.startswith("CODER_URL=http://127.0.0.1:")
        url = first.split("=", 1)[1]
        org = proc.stdout.readline().strip()
        assert org.startswith("CODER_ORG_ID=")
        admin = proc.stdout.readline().strip()
        assert admin.startswith("CODER_EMULATOR_ADMIN_TOKEN=")  # no default token line
        for tok in ("t1", "t2"):
            r = httpx.post(
                f"{url}/api/v2/chats",
                headers={"Coder-Session-Token": tok},
                json={
                    "organization_id": org.split("=", 1)[1],
                    "content": [{"type": "text", "text": "hi"}],
                },
            )
            assert r.status_code == 201
        r = httpx.get(f"{url}/api/v2/chats", headers={"Coder-Session-Token": "t2"})
        assert len(r.json()) == 1  # each token is its own user
        r = httpx.get(f"{url}/api/experimental/chats", headers={"Coder-Session-Token": "t2"})
        assert r.status_code == 200  # --era b1 serves both prefixes
        proc.send_signal(sig)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_default_token_line() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "coder_chat.emulator.cli"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        assert lines[0].startswith("CODER_URL=")
        tok = lines[2].split("=", 1)[1]
        assert lines[2].startswith("CODER_SESSION_TOKEN=")
        url = lines[0].split("=", 1)[1]
        assert (
            httpx.get(f"{url}/api/v2/chats", headers={"Coder-Session-Token": tok}).status_code
            == 200
        )
        # The default era's prefixes: b3 serves the core routes on /api/v2 only.
        assert httpx.get(
            f"{url}/api/experimental/chats", headers={"Coder-Session-Token": tok}
        ).status_code == (404 if default_era() == "b3" else 200)
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_help_describes_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "`" not in out  # no raw reST markup
    options = re.findall(r"^  (--[a-z-]+)", out, re.MULTILINE)
    assert set(options) >= {
        "--host",
        "--port",
        "--era",
        "--token",
        "--admin-token",
        "--organization-id",
        "--requires-action-timeout",
        "--ping-interval",
        "--delta-delay",
        "--delta-count",
        "--max-concurrent-root-chats",
    }
    # Every option line (or its continuation) carries a description.
    for opt in options:
        block = out.split("\n  " + opt, 1)[1].split("\n  -", 1)[0]
        assert len(block.split()) > 3, opt
    for era in ("b1", "b2", "b3"):
        assert f"  {era}  " in out

"""``prefect-coder doctor`` passes against the emulator at every server build, recognises
the build, never leaves a doctor chat live, and never shows the token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coder_chat.emulator import Emulator

from .helpers import TOKEN, assert_no_secret, coder_env

ROOT = Path(__file__).resolve().parents[2]
CODER_CHECKS = ["server", "token", "organization", "models", "build", "chat-routes", "stream"]
BUILD_EVIDENCE = {
    "b1": "B1 (004053e8): chats on /api/v2 and /api/experimental, `q=status:` rejected (400)",
    "b2": "B2 (18e18bf9): chats on /api/v2 and /api/experimental, `q=status:` accepted",
    "b3": "B3 (38c471cf or later): chats on /api/v2 only (/api/experimental 404)",
}


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_doctor_passes_at_every_build(
    chatd_era: str, chatd_emulator: Emulator, doctor: Any
) -> None:
    run = doctor("--smoke", "--json", env=coder_env(chatd_emulator))
    assert run.exit_code == 0, run.output
    report = run.json()
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True and report["counts"]["FAIL"] == 0
    for name in [*CODER_CHECKS, "smoke", "credentials"]:
        assert checks[name]["status"] == "OK", checks[name]
    assert checks["build"]["found"].startswith(BUILD_EVIDENCE[chatd_era])
    # B3 creates the route-check chat empty (no model call); older builds must send a
    # first message, whose run the archive stops.
    empty = "created empty: no model call" in checks["chat-routes"]["found"]
    assert empty is (chatd_era == "b3")
    assert checks["smoke"]["found"].startswith("reply 'Echo: prefect-coder doctor smoke test")
    # Unreadable chatd capacity and no fleet cap: a warning, not a failure.
    assert checks["limits"]["status"] == "WARN"
    # The default store lives in this test's PREFECT_HOME and was never created.
    assert checks["store"]["status"] == "WARN"
    assert "no file yet" in checks["store"]["found"]
    assert "several workers need PostgreSQL" in checks["store"]["found"]
    # Two doctor chats (route check, smoke), both labelled and archived: none left live.
    chats = chatd_emulator.chats()
    assert len(chats) == 2
    for chat in chats:
        assert chat["archived"] is True and chat["status"] == "waiting"
        assert set(chat["labels"]) == {"prefect-coder/doctor"}
    assert_no_secret(run.output + run.logs, TOKEN)


@pytest.mark.chatd_emulator(tokens=[TOKEN], era="b2")
def test_text_report_is_one_line_per_check(chatd_emulator: Emulator, doctor: Any) -> None:
    run = doctor(env=coder_env(chatd_emulator))
    assert run.exit_code == 0, run.output
    lines = run.output.strip().splitlines()
    assert lines[-1].startswith("OK: ") and "0 failure(s)" in lines[-1]
    names = [ln[6:].split(" ", 1)[0] for ln in lines[:-1]]
    assert names[: len(CODER_CHECKS) + 1] == ["credentials", *CODER_CHECKS]
    assert "smoke" not in names  # only with --smoke
    assert run.line("build").startswith("OK    build")
    assert run.line("store").startswith("WARN ")
    assert "→" in run.line("store")  # a warning carries its fix
    # Without --smoke no turn ran to its end: one route-check chat, archived.
    assert [c["archived"] for c in chatd_emulator.chats()] == [True]
    assert_no_secret(run.output + run.logs, TOKEN)


@pytest.mark.chatd_emulator(tokens=[TOKEN], era="b1")
def test_console_script_end_to_end(chatd_emulator: Emulator, tmp_path: Path) -> None:
    """The installed ``prefect-coder`` command in its own process: exit code, JSON on
    stdout, and neither stdout nor stderr holds any piece of the token."""
    script = Path(sys.executable).with_name("prefect-coder")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CODER_", "PREFECT_API"))},
        **coder_env(chatd_emulator),
        "PREFECT_HOME": str(tmp_path),
        "PREFECT_LOGGING_LEVEL": "DEBUG",
        # The tree under test, not whatever the editable install points at.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(
        [str(script), "doctor", "--smoke", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert {c["name"]: c["status"] for c in report["checks"]}["smoke"] == "OK"
    assert_no_secret(done.stdout + done.stderr, TOKEN)

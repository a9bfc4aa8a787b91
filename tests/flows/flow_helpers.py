"""Helpers shared by the Prefect-layer tests (imported as a module, not via conftest)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from coder_chat.emulator import Emulator

#: A token nobody would type by accident: the secrecy test scans for it everywhere.
TOKEN = f"tok-flows-{uuid.uuid4().hex}-SECRET"
ROOT = Path(__file__).resolve().parents[2]


def emu_directive(script: Any) -> str:
    """The in-text directive that scripts the emulator's model for this prompt."""
    return " #emu " + json.dumps(script)


def say(text: str) -> str:
    return emu_directive({"text": text})


def user_messages(emu: Emulator, chat_id: str) -> list[str]:
    """Texts of the user messages of a chat, oldest first."""
    out = []
    for m in emu.messages(chat_id, include_system=False):
        if m.get("role") != "user":
            continue
        parts = m.get("content") or []
        out.append("".join(p.get("text", "") for p in parts if p.get("type") == "text"))
    return out


def run_child(warm: Any, prefect_env: Any, code: str, *, timeout: float = 90, **env: str) -> Any:
    """Run Python code in a fresh process (a stand-in for a worker's flow-run process):
    forked from the session's warm process (``warm_python`` in tests/conftest.py), so
    it does not import Prefect again. The result has ``returncode``, ``stdout``,
    ``stderr`` (text), like ``subprocess.run(..., capture_output=True, text=True)``."""
    return warm.run(["-c", code], env=prefect_env.subprocess_env(**env), cwd=ROOT, timeout=timeout)

"""Helpers of the doctor's tests: the run record, the emulator's environment, the
secret scan."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coder_chat.emulator import Emulator

#: The session token of every doctor test's emulator: distinctive, so the secret scan
#: finds any piece of it.
TOKEN = "tk-7Qz9LmXw4Rk2Pv8NbJ3cYh"


@dataclass(frozen=True)
class Run:
    """One ``prefect-coder doctor`` run: exit code, stdout, and every log record's text."""

    exit_code: int
    output: str
    logs: str

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.output)
        return data

    def line(self, name: str) -> str:
        """The report line of check ``name`` (text output)."""
        found = [ln for ln in self.output.splitlines() if ln[6:].split(" ", 1)[0] == name]
        assert len(found) == 1, f"no single {name!r} line in:\n{self.output}"
        return found[0]


def assert_no_secret(text: str, secret: str, *, window: int = 6) -> None:
    """Neither ``secret`` nor any ``window``-character piece of it appears in ``text``."""
    pieces = {secret[i : i + window] for i in range(len(secret) - window + 1)}
    leaked = sorted(p for p in pieces if p in text)
    assert not leaked, f"secret pieces leaked: {leaked}"


def coder_env(emu: Emulator, token: str = TOKEN, **extra: str) -> dict[str, str]:
    """The environment that points the doctor at ``emu``."""
    return {
        "CODER_URL": emu.base_url,
        "CODER_SESSION_TOKEN": token,
        "CODER_ORG_ID": emu.organization_id,
        **extra,
    }

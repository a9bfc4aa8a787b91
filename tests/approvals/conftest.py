"""Fixtures of the approval tests: a fresh emulator per test, a real Prefect test
server whose flow runs are executed by `python -m prefect.engine` subprocesses
(what a process worker runs), like in production."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from approval_env import TOKEN

from coder_chat.emulator import Emulator


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator.running_in_thread(
        tokens=[TOKEN],
        delta_delay=0.0,
        aibridge_providers={
            "openai": "openai",
            "anthropic": "anthropic",
            "corp-claude": "anthropic",
        },
    ) as e:
        yield e

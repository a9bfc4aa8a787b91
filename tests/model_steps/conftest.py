"""Fixtures of the model-step tests: a fresh emulator per test (its AI Gateway
surfaces, event log and fault API), and a real Prefect test server for the
persisted ``model_step`` task."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from model_env import TOKEN

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

"""Fixtures: an in-loop emulator per test (fast), with short time constants."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coder_chat.emulator import Emulator


@pytest.fixture
async def emu(request: pytest.FixtureRequest) -> AsyncIterator[Emulator]:
    """Fresh emulator on the test loop; ``@pytest.mark.emu(**kw)`` overrides config."""
    marker = request.node.get_closest_marker("emu")
    kwargs = {"delta_delay": 0.002, "tokens": ["tok-alice", "tok-bob"]}
    if marker:
        kwargs.update(marker.kwargs)
    async with Emulator(**kwargs) as e:
        yield e


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emu(**kwargs): Emulator keyword arguments")

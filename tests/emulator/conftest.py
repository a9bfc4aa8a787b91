"""Fixtures: an in-loop emulator per test (fast), with short time constants."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from coder_chat.emulator import Emulator


@pytest.fixture
async def emu(request: pytest.FixtureRequest) -> AsyncIterator[Emulator]:
    """Fresh emulator on the test loop; ``@pytest.mark.emu(**kw)`` overrides config.

    The conformance scenarios were written against B2 (both prefixes, after_revision,
    history_version on status events), so that is this fixture's era unless the test is
    parametrized over ``era`` (``test_eras.py``, the wire-shape scenario)."""
    marker = request.node.get_closest_marker("emu")
    kwargs: dict[str, Any] = {
        "delta_delay": 0.002,
        "tokens": ["tok-alice", "tok-bob"],
        "era": "b2",
    }
    if "era" in request.fixturenames:  # a test parametrized over eras
        kwargs["era"] = request.getfixturevalue("era")
    if marker:
        kwargs.update(marker.kwargs)
    async with Emulator(**kwargs) as e:
        yield e


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emu(**kwargs): Emulator keyword arguments")

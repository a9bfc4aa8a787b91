"""pytest fixtures for testing code against the chatd emulator.

* ``chatd_emulator`` — function-scoped, thread-hosted, fresh state per test. Configure it
  with ``@pytest.mark.chatd_emulator(requires_action_timeout=0.2, ...)`` (any
  :class:`~coder_chat.emulator.Emulator` keyword).
* ``chatd_emulator_session`` — one emulator for the whole session (state shared).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import Emulator


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``chatd_emulator`` marker."""
    config.addinivalue_line(
        "markers", "chatd_emulator(**kwargs): keyword arguments for the chatd_emulator fixture"
    )


@pytest.fixture
def chatd_emulator(request: pytest.FixtureRequest) -> Iterator[Emulator]:
    """A fresh thread-hosted emulator per test (base_url, token, organization_id, faults…)."""
    marker = request.node.get_closest_marker("chatd_emulator")
    kwargs = dict(marker.kwargs) if marker else {}
    with Emulator.running_in_thread(**kwargs) as emu:
        yield emu


@pytest.fixture(scope="session")
def chatd_emulator_session() -> Iterator[Emulator]:
    """One thread-hosted emulator shared by the whole test session."""
    with Emulator.running_in_thread() as emu:
        yield emu

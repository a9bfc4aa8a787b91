"""pytest fixtures for testing code against the chatd emulator.

* ``chatd_emulator`` — function-scoped, thread-hosted, fresh state per test. Configure it
  with ``@pytest.mark.chatd_emulator(era="b1", requires_action_timeout=0.2, ...)`` (any
  :class:`~coder_chat.emulator.Emulator` keyword).
* ``chatd_era`` — the era under test, parametrized over every era (``b1``, ``b2``,
  ``b3``). A test that asks for it runs once per era, and ``chatd_emulator`` plays that
  era (unless the marker names one). Narrow it with
  ``@pytest.mark.parametrize("chatd_era", ["b2", "b3"])``.
* ``chatd_emulator_session`` — one emulator for the whole session (state shared).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .eras import ERA_NAMES
from .server import Emulator


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``chatd_emulator`` marker."""
    config.addinivalue_line(
        "markers",
        "chatd_emulator(**kwargs): Emulator keyword arguments for the chatd_emulator fixture "
        "(e.g. era='b1')",
    )


@pytest.fixture(params=ERA_NAMES)
def chatd_era(request: pytest.FixtureRequest) -> str:
    """The era under test; a test using it runs once per era (``b1``, ``b2``, ``b3``)."""
    return str(request.param)


def emulator_kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``Emulator`` keywords for a test: its ``chatd_emulator`` marker, plus the era
    from ``chatd_era`` when the test runs per era. Handy for suites with their own
    emulator fixture: ``Emulator(**emulator_kwargs(request))``."""
    marker = request.node.get_closest_marker("chatd_emulator")
    kwargs = dict(marker.kwargs) if marker else {}
    if "era" not in kwargs and "chatd_era" in request.fixturenames:
        kwargs["era"] = request.getfixturevalue("chatd_era")
    return kwargs


@pytest.fixture
def chatd_emulator(request: pytest.FixtureRequest) -> Iterator[Emulator]:
    """A fresh thread-hosted emulator per test (base_url, token, organization_id, faults…)."""
    with Emulator.running_in_thread(**emulator_kwargs(request)) as emu:
        yield emu


@pytest.fixture(scope="session")
def chatd_emulator_session() -> Iterator[Emulator]:
    """One thread-hosted emulator shared by the whole test session."""
    with Emulator.running_in_thread() as emu:
        yield emu

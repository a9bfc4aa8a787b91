"""Prefect blocks of prefect-coder: ``CoderCredentials`` and ``ChatStateStore``.

Imported by the ``prefect.collections`` entry point and by
``prefect block register -m prefect_coder.blocks``.

``StateStore`` (what ``ChatStateStore.get_store()`` returns) is
imported on first access, not with this package: Prefect imports every installed
collection in every process that looks a block or worker type up — each
``prefect worker start``, ``prefect deploy``, CLI call — and the store brings
SQLAlchemy (≈ 0.6-0.9 CPU-s), which only a process that opens a store needs
(docs/performance.md, round 10c).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .chat_state_store import ChatStateStore
from .credentials import CoderCredentials, InvalidCoderCredentialsError

if TYPE_CHECKING:
    from .state import StateStore

#: The public names: the two blocks, what ``ChatStateStore.get_store()`` returns and
#: the error a bad credentials block raises. The store's records, leases and keys are
#: internal (``prefect_coder.blocks.state``); the product's errors are gathered in
#: :mod:`prefect_coder.errors`.
__all__ = ["ChatStateStore", "CoderCredentials", "InvalidCoderCredentialsError", "StateStore"]

#: Names re-exported from ``.state``, imported on first access (see above).
_FROM_STATE = frozenset({"StateStore"})


def __getattr__(name: str) -> Any:
    if name in _FROM_STATE:
        value = getattr(importlib.import_module(".state", __name__), name)
        globals()[name] = value  # later accesses are plain module attributes
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_STATE)

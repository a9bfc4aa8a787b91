"""Prefect blocks of prefect-coder: ``CoderCredentials`` and ``ChatStateStore``.

Imported by the ``prefect.collections`` entry point and by
``prefect block register -m blocks``.

The state store's names (``StateStore``, ``HeldLease``, ``workflow_key`` …) are
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
from .credentials import CoderCredentials

if TYPE_CHECKING:
    from .state import (
        Checkpoint,
        HeldLease,
        JournalEntry,
        Lease,
        LeaseLostError,
        LeaseUnavailableError,
        LedgerEntry,
        SchemaVersionError,
        StateStore,
        StateStoreConfigError,
        StateStoreError,
        StoreTransaction,
        StrandedChat,
        chat_key,
        workflow_key,
    )

__all__ = [
    "ChatStateStore",
    "Checkpoint",
    "CoderCredentials",
    "HeldLease",
    "JournalEntry",
    "Lease",
    "LeaseLostError",
    "LeaseUnavailableError",
    "LedgerEntry",
    "SchemaVersionError",
    "StateStore",
    "StateStoreConfigError",
    "StateStoreError",
    "StoreTransaction",
    "StrandedChat",
    "chat_key",
    "workflow_key",
]

#: Names re-exported from ``.state``, imported on first access (see above).
_FROM_STATE = frozenset(__all__) - {"ChatStateStore", "CoderCredentials"}


def __getattr__(name: str) -> Any:
    if name in _FROM_STATE:
        value = getattr(importlib.import_module(".state", __name__), name)
        globals()[name] = value  # later accesses are plain module attributes
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_STATE)

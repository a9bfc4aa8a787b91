"""Prefect blocks of prefect-coder: ``CoderCredentials`` and ``ChatStateStore``.

Imported by the ``prefect.collections`` entry point and by
``prefect block register -m blocks``.
"""

from .chat_state_store import ChatStateStore
from .credentials import CoderCredentials
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

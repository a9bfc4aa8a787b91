"""The chat state store: checkpoints, send journal, tool ledger, leases, stranded chats.

See docs/state-store.md. ``StateStore`` works in any asyncio program; the
``blocks.ChatStateStore`` Prefect block is its saved configuration.
"""

from .errors import (
    LeaseLostError,
    LeaseUnavailableError,
    SchemaChangedError,
    SchemaVersionError,
    StateStoreConfigError,
    StateStoreError,
    StoreUnavailableError,
)
from .leases import HeldLease, chat_key, default_holder, workflow_key
from .records import Checkpoint, JournalEntry, Lease, LedgerEntry, StrandedChat
from .schema import SCHEMA_VERSION
from .store import StateStore, StoreTransaction
from .urls import default_sqlite_path, default_url

__all__ = [
    "SCHEMA_VERSION",
    "Checkpoint",
    "HeldLease",
    "JournalEntry",
    "Lease",
    "LeaseLostError",
    "LeaseUnavailableError",
    "LedgerEntry",
    "SchemaChangedError",
    "SchemaVersionError",
    "StateStore",
    "StateStoreConfigError",
    "StateStoreError",
    "StoreTransaction",
    "StoreUnavailableError",
    "StrandedChat",
    "chat_key",
    "default_holder",
    "default_sqlite_path",
    "default_url",
    "workflow_key",
]

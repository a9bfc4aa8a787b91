"""Crash recovery of one step's turn: settle-wait, ledger reconcile, result recovery.

A hard crash (OOM kill, host loss, SIGKILL) runs no ``finally`` block. When the
step runs again on its checkpointed chat it must not just resubmit:

1. **Settle-wait** — stop what the crash left behind and wait until the chat
   actually settles (:meth:`TurnRecovery.settle`). A client-tool pause is
   reconciled, never interrupted away; anything else is interrupted and polled
   to a terminal status.
2. **Ledger reconcile** — a ``requires_action`` pause is answered from the
   crash-safe tools' ledger (:meth:`TurnRecovery.reconcile`).
3. **Result check** — the crashed attempt may already have finished the step's
   work: recover its result from history instead of resubmitting
   (:meth:`TurnRecovery.check_result`) — only from a history that ends with the
   turn the settle's status read covered; a send that landed later is settled
   again (followed), never taken for a result.

The pure decisions live in :mod:`coder_chat.core.recovery`; this module only
does the I/O and records every decision (:attr:`RecoveryOutcome.decisions`:
what was seen, what was decided, why).

``coder_chat`` imports no store: anything shaped like :class:`RecoveryStore`
works — ``blocks.StateStore`` does. Journal entries are
:class:`coder_chat.core.journal.JournalEntry` (the store keeps that very model).

Modules: :mod:`.contract` (timings, protocols, outcome, error), :mod:`.shell` (what
the stages share), :mod:`.reconcile`, :mod:`.result_check`, :mod:`.settle`
(:class:`TurnRecovery`: settle-wait, follow, run).
"""

from .contract import (
    Follower,
    JournalStore,
    RecoveryOutcome,
    RecoveryStore,
    RecoveryTimings,
    SettleResult,
    ToolOutcomeLostError,
    timeline_origin,
)
from .settle import TurnRecovery

__all__ = [
    "Follower",
    "JournalStore",
    "RecoveryOutcome",
    "RecoveryStore",
    "RecoveryTimings",
    "SettleResult",
    "ToolOutcomeLostError",
    "TurnRecovery",
    "timeline_origin",
]

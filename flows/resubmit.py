"""The seam every resubmission on a checkpointed chat goes through.

Any re-run of a step sends its prompt again as a new user turn. Sending it
*straight away* is wrong: the previous attempt's run may still be live (a
timeout's server interrupt is asynchronous and best-effort; a crash leaves the
run going), so the new prompt would queue behind it, burn its own timeout, and
the old run's trailing output would be absorbed into the retried turn.

:func:`settle_before_resubmit` is called by ``run_turn`` before every such send.
Today it does the minimal safe thing — interrupt best-effort (a 409 means no
live run: the good case) and poll the chat to a settled status, bounded. The
crash-recovery work replaces its body with the full settle-wait of the durable
design (reconcile the tool ledger before any interrupt, recover a finished
attempt's result from history, sleep out the journaled send's commit window),
keeping this signature.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from coder_chat.errors import CoderApiError
from coder_chat.rest import ChatClient
from flows.errors import ChatNotSettledError

__all__ = ["SETTLED_STATUSES", "SettleOutcome", "settle_before_resubmit"]

#: Statuses after which a new user message starts a fresh run at once.
SETTLED_STATUSES = frozenset({"waiting", "completed", "error"})


@dataclass(frozen=True, slots=True)
class SettleOutcome:
    """What the settle-wait found and did."""

    chat_id: str
    status: str
    interrupted: bool
    waited_s: float
    reason: str


async def settle_before_resubmit(
    client: ChatClient,
    chat_id: str,
    *,
    reason: str,
    bound_s: float = 15.0,
    poll_s: float = 0.2,
    logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
) -> SettleOutcome:
    """Stop whatever a previous attempt left running on ``chat_id`` and wait until the
    chat settles, within ``bound_s``. Raises :class:`ChatNotSettledError` otherwise.

    ``reason`` says why a resubmission happens (``"retry after CoderChatError"``,
    ``"journaled attempt 1 never recorded a result"`` …); the later crash-recovery
    logic keys its ``cut_short`` decision on it.
    """
    log = logger or logging.getLogger(__name__)
    started = time.monotonic()
    deadline = started + bound_s
    status: str | None = None
    interrupted = False
    # A paused chat (requires_action) would hold a new prompt forever, so the
    # minimal seam interrupts it too; the ledger reconcile will replace this.
    try:
        await client.interrupt_chat(chat_id, timeout=max(0.001, deadline - time.monotonic()))
        interrupted = True
    except CoderApiError as exc:
        if exc.status != 409:  # 409: nothing running — the good case
            log.warning("interrupt before resubmit on chat %s failed: %s", chat_id, exc)
    except (TimeoutError, OSError) as exc:
        log.warning("interrupt before resubmit on chat %s failed: %r", chat_id, exc)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            chat = await client.get_chat(chat_id, timeout=remaining)
            status = chat.status
        except (CoderApiError, TimeoutError, OSError) as exc:
            log.warning("status poll of chat %s failed: %s", chat_id, exc)
        if status in SETTLED_STATUSES:
            waited = time.monotonic() - started
            log.info(
                "chat %s settled (%s) after %.2fs before resubmitting: %s",
                chat_id,
                status,
                waited,
                reason,
            )
            return SettleOutcome(chat_id, status, interrupted, waited, reason)
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    raise ChatNotSettledError(chat_id, status, time.monotonic() - started)

"""Which failed turns Prefect may retry.

``retryable`` means the *failure* is transient, not that a re-run is free: a
re-run resubmits the prompt as a new user turn. So only transient failures are
retried, and every resubmission on a checkpointed chat first goes through
:func:`prefect_coder.flows.recovery.before_send.recover_before_send` (settle-wait,
ledger reconcile, result recovery) — never straight back onto a possibly live run.

Network failures (:class:`~coder_chat.errors.CoderTransportError`: a reset
connection, a refused dial, an httpx connect/read/write timeout) are transient
*through recovery*: the request may have landed (``retry_safe`` is false for a
``POST /messages`` whose response was lost), so the retry never re-POSTs
blindly — its recover-before-send reads the journal and the chat's history and
either recovers the landed attempt or journals a resubmission. An httpx
timeout (:class:`~coder_chat.errors.CoderTimeoutError`, the credentials'
``http_timeout``) is retried; the turn's own total deadline (a builtin
``TimeoutError`` from ``generate(timeout=turn_timeout)``) is not: the same
prompt would meet the same deadline.
"""

from __future__ import annotations

from typing import Any

import httpx
from prefect.states import State

from coder_chat.errors import CoderError, is_transient
from prefect_coder.blocks.errors import PrefectCoderError
from prefect_coder.blocks.state import faults

__all__ = ["is_retryable_failure", "is_transient_failure", "retry_if_retryable"]


def is_retryable_failure(exc: BaseException | None) -> bool:
    """Whether a failed turn may be retried: transient failures only.

    The HTTP part — no response (the request may have landed: a reset, a refused
    dial, an httpx timeout) or 408/425/429/5xx — is :func:`coder_chat.errors.is_transient`,
    the one rule the agent's leave-landed-runs and recovery's submit use too, so
    the task's retry policy never disagrees with them about a landed request.
    Added here: the chat's and the stream's own verdicts. 401/403/404, the
    archived-chat 400, the total deadline (a builtin ``TimeoutError``; an httpx
    timeout is a ``CoderTimeoutError``, the network's, and transient), a busy
    workflow and every programming error hit the same wall on every attempt.
    The product's own errors say it themselves (:attr:`PrefectCoderError.retryable`):
    a turn slot lost before the send (``TurnSlotLostError``: nothing was sent) is
    retried, and the retry waits for a slot again; so is a state store that stayed
    unreachable or locked past its own retries (``StoreUnavailableError``).
    """
    if is_transient(exc):
        return True
    # The state store's faults, classified in one place (blocks/state/faults.py): a
    # restart, a failover or a held SQLite write lock that outlasted the store's own
    # retries is StoreUnavailableError (retryable, below); a raw database error that
    # escaped it is judged by the same rule.
    if (
        isinstance(exc, BaseException)
        and not isinstance(exc, CoderError | PrefectCoderError)
        and faults.is_store_error(exc)
    ):
        return faults.is_transient(exc)
    # The Prefect API's faults (a server restart, a 5xx, a reset connection) come out of
    # Prefect's client as raw httpx errors (the Coder client wraps its own, above).
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        return status in (408, 425, 429) or status >= 500
    if isinstance(exc, httpx.TransportError):
        return True
    # Every error of the client and of the product says it in one attribute.
    if isinstance(exc, CoderError | PrefectCoderError):
        return exc.retryable
    return False


def is_transient_failure(exc: BaseException | None) -> bool:
    """Whether a run that finally failed with ``exc`` left a chat that a rerun or
    ``recover-turn`` can continue (the failure was transient, only the retries ran
    out): the failure handler then leaves the chat live instead of archiving it."""
    return is_retryable_failure(exc)


async def retry_if_retryable(_task: Any, _task_run: Any, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``. Async on purpose: a sync one cannot read an
    async task's result (it gets a coroutine) and would never retry."""
    try:
        exc = await state.aresult(raise_on_failure=False)
    except Exception:
        return False
    return isinstance(exc, BaseException) and is_retryable_failure(exc)

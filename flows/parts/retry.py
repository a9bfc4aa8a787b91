"""Which failed turns Prefect may retry.

``retryable`` means the *failure* is transient, not that a re-run is free: a
re-run resubmits the prompt as a new user turn. So only transient failures are
retried, and every resubmission on a checkpointed chat first goes through
:func:`prefect_coder.flows.recovery.recover_before_send` (settle-wait, ledger reconcile,
result recovery) — never straight back onto a possibly live run.
"""

from __future__ import annotations

from typing import Any

from prefect.states import State

from coder_chat.errors import CoderApiError, CoderChatError, CoderStreamError

__all__ = ["RETRYABLE_HTTP", "is_retryable_failure", "retry_if_retryable"]

#: REST statuses worth a backoff-and-retry (durable design, "Handling errors").
RETRYABLE_HTTP = frozenset({408, 425, 429})


def is_retryable_failure(exc: BaseException | None) -> bool:
    """Whether a failed turn may be retried: transient failures only.

    401/403/404, the archived-chat 400, the total deadline, a busy workflow and
    every programming error hit the same wall on every attempt.
    """
    if isinstance(exc, CoderChatError):
        return exc.retryable
    if isinstance(exc, CoderStreamError):
        return exc.is_retryable
    if isinstance(exc, CoderApiError):
        return exc.status in RETRYABLE_HTTP or exc.status >= 500
    return False


async def retry_if_retryable(_task: Any, _task_run: Any, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``. Async on purpose: a sync one cannot read an
    async task's result (it gets a coroutine) and would never retry."""
    try:
        exc = await state.aresult(raise_on_failure=False)
    except Exception:
        return False
    return isinstance(exc, BaseException) and is_retryable_failure(exc)

"""A step's result written before its task returns: a write that fails is loud.

Prefect persists a task's result when the task's transaction commits, *after* the
task run was already set ``Completed``; a commit whose write fails (result storage
unwritable, full, unreachable) is logged and rolled back, and the task stays
``Completed`` with nothing persisted (issue 30, item 7, reproduced with an
unwritable result directory in ``tests/faults/test_result_storage.py``). A later
run of the workflow then finds no stored result for the step, and only its
recovery from the chat's history keeps it from being sent again.

:func:`write_step_result` closes that window: the task writes its own result record,
under the task's transaction key and through the task's result store, before it
returns. A write that fails raises :class:`ResultNotPersistedError` (retryable), so
the task fails transiently — Prefect's task retries apply, each retry recovers the
finished turn from the chat's history before it sends anything, and a run whose
retries run out fails with the chat kept live (``coder.workflow.resumable``) — and
emits ``coder.result.not-persisted``. A written record is the one the commit would
have written, so the commit's second write of the same bytes is switched off.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from prefect.context import TaskRunContext
from prefect.events import emit_event
from prefect.transactions import get_transaction

from prefect_coder.blocks.errors import PrefectCoderError
from prefect_coder.flows.observe.observer import chat_resource
from prefect_coder.flows.observe.run_log import run_logger

__all__ = ["NOT_PERSISTED_EVENT", "ResultNotPersistedError", "write_step_result"]

#: Emitted when a step's result could not be written (the task then fails, retryable).
NOT_PERSISTED_EVENT = "coder.result.not-persisted"

T = TypeVar("T")

_log = logging.getLogger(__name__)


class ResultNotPersistedError(PrefectCoderError, RuntimeError):
    """A step finished but its result could not be written to Prefect's result storage.

    Retryable: the step's turn is in the chat's history, so a retry (or a rerun)
    recovers it from there and sends nothing; the write is tried again. The storage's
    own error is the ``__cause__`` (and in the run's log).
    """

    retryable = True

    def __init__(self, workflow_id: str, step: str, key: str, error: str) -> None:
        self.workflow_id = workflow_id
        self.step = step
        self.key = key
        self.error = error
        super().__init__(
            f"step {step!r} of workflow {workflow_id!r} finished, but its result could not "
            f"be written to Prefect's result storage (key {key!r}: {error}). Check that the "
            "result storage (PREFECT_RESULTS_LOCAL_STORAGE_PATH or the default storage "
            "block) is writable; a retry or a rerun continues the step (an agent turn "
            "is recovered from the chat's history, not sent again)."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.workflow_id, self.step, self.key, self.error))


async def write_step_result(result: T, *, workflow_id: str, step: str) -> T:
    """Write ``result`` as the current task's persisted result now; return it.

    The event names the result's ``chat_id`` when it has one (a turn's does).

    Outside a task that persists its result under a key (called as a plain function,
    ``persist_result=False``) this does nothing. Raises
    :class:`ResultNotPersistedError` when the storage refuses the write.
    """
    txn = get_transaction()
    if txn is None or not txn.key or txn.store is None or not txn.write_on_commit:
        return result
    store = txn.store
    key = txn.key
    # The record the commit would have written: the same key, store and expiration.
    ctx = TaskRunContext.get()
    ttl = ctx.task.cache_expiration if ctx is not None else None
    # (A plain aware datetime: Prefect's record validates it into its own DateTime.)
    expiration = cast(Any, datetime.now(UTC) + ttl) if ttl is not None else None
    try:
        record = store.create_result_record(result, key=key, expiration=expiration)
        # Under a SERIALIZABLE cache policy the transaction holds the key's lock: write
        # as its holder (Prefect keeps it on the transaction; absent, the default).
        await store.apersist_result_record(record, holder=getattr(txn, "_holder", None))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        chat_id = getattr(result, "chat_id", None)
        run_logger(__name__).error(
            "step %s: result not persisted (key %s): %s", step, key, error, exc_info=True
        )
        try:
            emit_event(
                NOT_PERSISTED_EVENT,
                resource=chat_resource(chat_id, workflow_id, step),
                related=[
                    {
                        "prefect.resource.id": f"coder.workflow.{workflow_id}",
                        "prefect.resource.role": "workflow",
                    }
                ],
                payload={
                    "workflow_id": workflow_id,
                    "step": step,
                    "chat_id": chat_id,
                    "key": key,
                    "error": type(exc).__name__,
                },
            )
        except Exception:  # the failure itself is what must be loud; the event is extra
            _log.debug("could not emit %s", NOT_PERSISTED_EVENT, exc_info=True)
        raise ResultNotPersistedError(workflow_id, step, key, error) from exc
    # The record is written; the commit would only write the same bytes again (and
    # swallow a failure of that second write, which loses nothing now).
    txn.write_on_commit = False
    return result

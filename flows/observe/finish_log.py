"""Prefect's routine "Finished in state Completed()" line of a ``run-turn`` task run, dropped.

Prefect's task engine logs one INFO line when a task run ends. For a turn that
completed normally it says nothing the run does not show already: the task run's
Completed state (in the UI, and as the ``prefect.task-run.Completed`` event) and our
``coder.turn.settled`` event carry the same and more. The line itself was the dearest
log record of a fan-out worker: rendered by Prefect's rich console handler, queued by
its API log handler, shipped by its log thread and stored by the server — ≈ 4 % of
the worker's event loop and one server row per turn (docs/performance.md, round 9).

Only that exact line of a ``run-turn`` task run is dropped: a turn that ended in any
other state (Failed, Crashed, AwaitingRetry, Cached — a step returned from storage)
logs as before, and so does every other task. ``PREFECT_CODER_TURN_FINISHED_LOG=1``
on the worker keeps the line. The filter sits on Prefect's ``prefect.task_runs``
logger (a logging filter on a named logger; no handler is touched).
"""

from __future__ import annotations

import logging
import os

__all__ = ["KEEP_ENV", "RoutineTurnFinish", "quiet_routine_turn_finish"]

#: Environment variable: ``1`` keeps Prefect's "Finished in state Completed()" line
#: of every ``run-turn`` task run.
KEEP_ENV = "PREFECT_CODER_TURN_FINISHED_LOG"

#: The task whose routine finish line is dropped (``flows/turn/durable_turn.run_turn``).
TURN_TASK_NAME = "run-turn"
_ROUTINE = "Finished in state Completed()"
_LOGGER = "prefect.task_runs"


class RoutineTurnFinish(logging.Filter):
    """Drops the INFO "Finished in state Completed()" record of a ``run-turn`` task run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.INFO
            and record.msg == _ROUTINE
            and getattr(record, "task_name", None) == TURN_TASK_NAME
        )


def quiet_routine_turn_finish() -> bool:
    """Install :class:`RoutineTurnFinish` on Prefect's task-run logger once per process;
    True if this call installed it. ``PREFECT_CODER_TURN_FINISHED_LOG=1`` keeps the line
    (and removes a filter an earlier call installed)."""
    logger = logging.getLogger(_LOGGER)
    present = [f for f in logger.filters if isinstance(f, RoutineTurnFinish)]
    if os.environ.get(KEEP_ENV, "").strip() == "1":
        for f in present:
            logger.removeFilter(f)
        return False
    if present:
        return False
    logger.addFilter(RoutineTurnFinish())
    return True

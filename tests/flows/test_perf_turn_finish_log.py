"""Prefect's routine "Finished in state Completed()" line of a ``run-turn`` task run is
dropped (``flows/observe/finish_log.py``, docs/performance.md round 9); every other
finish line stays, and ``PREFECT_CODER_TURN_FINISHED_LOG=1`` keeps it.

End to end through a real workflow flow run: the records are caught by a handler on
Prefect's ``prefect.task_runs`` logger itself, i.e. after its filters, where Prefect's
own console and API handlers would get them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from flow_helpers import say

from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.observe.finish_log import (
    KEEP_ENV,
    RoutineTurnFinish,
    quiet_routine_turn_finish,
)


class _Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def task_run_records() -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger("prefect.task_runs")
    catch = _Catch()
    logger.addHandler(catch)
    try:
        yield catch.records
    finally:
        logger.removeHandler(catch)


def _finished(records: list[logging.LogRecord], workflow_id: str) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if r.getMessage().startswith("Finished in state")
        and getattr(r, "task_run_name", "").startswith(workflow_id)
    ]


async def test_a_routine_turn_logs_no_finish_line_unless_kept(
    settings: WorkflowSettings,
    workflow_id: str,
    task_run_records: list[logging.LogRecord],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = settings.model_copy(update={"artifacts": False})
    steps = [Step(name="only", prompt="go" + say("done"))]
    monkeypatch.delenv(KEEP_ENV, raising=False)
    results = await agent_workflow(workflow_id, steps, settings)
    assert [r.text for r in results] == ["done"]
    assert _finished(task_run_records, workflow_id) == []
    # A re-run returns the step from storage: that line (Cached) stays.
    await agent_workflow(workflow_id, steps, settings)
    assert _finished(task_run_records, workflow_id) == ["Finished in state Cached(type=COMPLETED)"]

    # Kept: the next workflow run's block load takes the filter off again.
    monkeypatch.setenv(KEEP_ENV, "1")
    try:
        await agent_workflow(workflow_id + "-kept", steps, settings)
        assert _finished(task_run_records, workflow_id + "-kept") == [
            "Finished in state Completed()"
        ]
    finally:
        monkeypatch.delenv(KEEP_ENV)
        assert quiet_routine_turn_finish() is True  # back on for the rest of the session


def test_only_the_routine_line_of_a_turn_is_dropped() -> None:
    def record(msg: str, level: int = logging.INFO, task: str = "run-turn") -> logging.LogRecord:
        rec = logging.LogRecord("prefect.task_runs", level, __file__, 1, msg, None, None)
        rec.task_name = task
        return rec

    f = RoutineTurnFinish()
    assert not f.filter(record("Finished in state Completed()"))
    assert f.filter(record("Finished in state Completed()", task="archive-chat"))
    assert f.filter(record("Finished in state Failed('boom')", level=logging.ERROR))
    assert f.filter(record("Finished in state AwaitingRetry()", level=logging.ERROR))
    assert f.filter(record("Finished in state Cached(type=COMPLETED)"))
    assert f.filter(record("step s settled on chat c", level=logging.INFO))

"""A person's decision given to an earlier flow run of the workflow, found again.

**The window (chaos, issue 30).** A person approves a suspended run in the Prefect UI;
Prefect keeps the answer as that *flow run's* input (:func:`response_keys`) and
schedules the run again. The resumed run reads the answer and records the decision
under the step's key (``record-approval``) — but if it dies or fails in between (its
process killed, the Prefect API restarting while it reads the input, the result
storage refusing the record past its retries), the decision exists only as the input
of a run that will not run again: the reconciler's rerun is a NEW flow run, which
found no recorded decision, suspended again and asked the person a second time (a
direct call could not suspend at all: the workflow could not finish).

So before suspending, a run looks for an answer given to an earlier run of the same
flow for the same workflow and step: recent runs of the flow (within the approval's
own timeout: an answer cannot be older than its question), whose ``workflow_id``
parameter is this one, that hold a response under the step's key. The newest such
answer is the person's decision; the run records it and goes on. One query and one
input read per earlier run of the workflow, and only at a point where the run would
otherwise wait for a person.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
)
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

__all__ = ["EarlierAnswer", "answer_given_to_an_earlier_run", "response_keys"]

#: How many recent runs of the flow are read (newest first).
_RUNS_READ = 200


def response_keys(step_name: str) -> tuple[str, ...]:
    """The flow-run input keys a person's answer at ``step_name`` may be stored under:
    Prefect keys it ``<state>-<pause key>-response`` (``prefect.input``'s keyset of a
    paused state; the state is named Suspended, or Paused for a run paused in place),
    the pause key being the suspend call's ``approval-<step>``."""
    return tuple(f"{state}-approval-{step_name}-response" for state in ("suspended", "paused"))


class EarlierAnswer:
    """An answer found on an earlier run: its run id and the submitted values."""

    __slots__ = ("flow_run_id", "values")

    def __init__(self, flow_run_id: UUID, values: dict[str, Any]) -> None:
        self.flow_run_id = flow_run_id
        self.values = values


async def answer_given_to_an_earlier_run(
    *,
    flow_name: str,
    current_run: UUID | None,
    workflow_id: str,
    step_name: str,
    within_s: float,
) -> EarlierAnswer | None:
    """The newest answer at ``step_name`` given to another run of ``flow_name`` for
    ``workflow_id`` in the last ``within_s`` seconds (its expected start), else None.
    Errors of the lookup propagate: the caller decides whether to ask again."""
    since = datetime.now(UTC) - timedelta(seconds=within_s)
    # (the host's clock: against a window of the approval's timeout, hours, skew is noise)
    flow_run_filter = FlowRunFilter(
        expected_start_time=FlowRunFilterExpectedStartTime.model_validate({"after_": since})
    )
    if current_run is not None:
        flow_run_filter.id = FlowRunFilterId(not_any_=[current_run])
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            flow_run_filter=flow_run_filter,
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=_RUNS_READ,
        )
        for run in runs:
            if (run.parameters or {}).get("workflow_id") != workflow_id:
                continue
            for key in response_keys(step_name):
                value = await _input(client, run.id, key)
                if value is not None:
                    return EarlierAnswer(run.id, value)
    return None


async def _input(client: PrefectClient, flow_run_id: UUID, key: str) -> dict[str, Any] | None:
    """A flow run's input under ``key`` as a dict; None when there is none."""
    try:
        raw = await client.read_flow_run_input(flow_run_id=flow_run_id, key=key)
    except ObjectNotFound:
        return None
    except PrefectHTTPStatusError as exc:  # how this client says "no such input"
        if exc.response.status_code == 404:
            return None
        raise
    value = json.loads(raw) if isinstance(raw, str) and raw else raw
    return value if isinstance(value, dict) else None

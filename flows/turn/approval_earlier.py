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

So a run that asks tags itself first (:func:`asked_tag`: the workflow's id), and
before suspending a run looks for an answer given to an earlier run for the same
workflow and step: the runs with that tag (exact), else — for a run asked before the
tag existed, or whose tagging failed — recent runs of the flow (within the approval's
own timeout: an answer cannot be older than its question; the newest
``_RUNS_READ``) whose ``workflow_id`` parameter is this one; among them, those that
hold a response under the step's key. The newest such answer is the person's
decision; the run records it and goes on. A query or two and one input read per
earlier run of the workflow, only at a point where the run would otherwise wait for a
person.
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
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

__all__ = [
    "EarlierAnswer",
    "answer_given_to_an_earlier_run",
    "asked_tag",
    "response_keys",
    "tag_as_asked",
]

#: How many recent runs of the flow are read (newest first).
_RUNS_READ = 200


def asked_tag(workflow_id: str) -> str:
    """The tag of every flow run that asked a person for a decision in ``workflow_id``
    (also a filter for such runs in the Prefect UI)."""
    return f"coder-approval-asked:{workflow_id}"


async def tag_as_asked(flow_run_id: UUID, tags: list[str], workflow_id: str) -> None:
    """Add :func:`asked_tag` to the run's tags (before it suspends); errors propagate."""
    tag = asked_tag(workflow_id)
    if tag in tags:
        return
    async with get_client() as client:
        await client.update_flow_run(flow_run_id, tags=[*tags, tag])


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
    current_run: UUID,
    workflow_id: str,
    step_name: str,
    within_s: float,
) -> EarlierAnswer | None:
    """The newest answer at ``step_name`` given to another run of ``flow_name`` for
    ``workflow_id`` in the last ``within_s`` seconds (its expected start), else None —
    also None when ``current_run`` holds an answer of its own (it was resumed: its own
    suspend call returns it, and a person's answer to THIS run wins over an older one;
    no query of other runs). Errors of the lookup propagate: the caller decides
    whether to ask again."""
    async with get_client() as client:
        if await _answer_of(client, current_run, step_name) is not None:
            return None
        tagged = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(not_any_=[current_run]),
                tags=FlowRunFilterTags(all_=[asked_tag(workflow_id)]),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=_RUNS_READ,
        )
        found = await _newest_answer(client, tagged, workflow_id, step_name)
        if found is not None:
            return found
        since = datetime.now(UTC) - timedelta(seconds=within_s)
        # (the host's clock: against a window of the approval's timeout, hours, skew is
        # noise); the tagged runs were read already
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(not_any_=[current_run, *(r.id for r in tagged)]),
                expected_start_time=FlowRunFilterExpectedStartTime.model_validate(
                    {"after_": since}
                ),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=_RUNS_READ,
        )
        return await _newest_answer(client, runs, workflow_id, step_name)


async def _newest_answer(
    client: PrefectClient, runs: list[FlowRun], workflow_id: str, step_name: str
) -> EarlierAnswer | None:
    """The first of ``runs`` (newest first) of ``workflow_id`` holding an answer."""
    for run in runs:
        if (run.parameters or {}).get("workflow_id") != workflow_id:
            continue
        value = await _answer_of(client, run.id, step_name)
        if value is not None:
            return EarlierAnswer(run.id, value)
    return None


async def _answer_of(
    client: PrefectClient, flow_run_id: UUID, step_name: str
) -> dict[str, Any] | None:
    """The answer at ``step_name`` a run holds (under any of :func:`response_keys`)."""
    for key in response_keys(step_name):
        value = await _input(client, flow_run_id, key)
        if value is not None:
            return value
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

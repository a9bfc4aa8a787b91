"""What our own events cost the Prefect server per turn (docs/performance.md, round 11a).

Every related resource of an event is a row the server's event persister writes (and
its triggers service walks): ≈ 0.5 ms of server CPU each, measured. A routine turn's
two events of ours (``coder.turn.settled``, ``coder.chat.archived``) carried the step
as a related resource of its own (``coder.step.<workflow>.<step>``, role ``step``),
although the payload names the step. Now the step is a label of the event's resource
(``coder.step``) and the workflow stays the one related resource of ours, so

* the server stores one related resource fewer per event of ours (counted from the
  events the real test server stored);
* the step is still matchable: an event filter on the resource's labels finds it (an
  automation's ``match`` uses the same labels).
"""

from __future__ import annotations

import asyncio
from typing import Any

from flow_helpers import say

from prefect_coder.flows.common.params import Step, WorkflowSettings


async def _events(body: dict[str, Any], want: int) -> list[dict[str, Any]]:
    """Events the server stored that match ``body``'s filter, once ``want`` arrived
    (events reach it through the events worker and its persister: bounded poll)."""
    from prefect.client.orchestration import get_client

    events: list[dict[str, Any]] = []
    async with get_client() as client:
        for _ in range(40):
            resp = await client._client.post("/events/filter", json={"filter": body, "limit": 20})
            resp.raise_for_status()
            events = resp.json()["events"]
            if len(events) >= want:
                break
            await asyncio.sleep(0.25)
    return events


async def test_our_events_carry_the_step_as_a_label_not_a_related_resource(
    settings: WorkflowSettings, workflow_id: str
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    await agent_workflow(
        workflow_id,
        [Step(name="only", prompt="go" + say("done"))],
        settings.model_copy(update={"artifacts": False}),
    )
    names = ["coder.turn.settled", "coder.chat.archived"]
    events = await _events(
        {"event": {"name": names}, "any_resource": {"id": [f"coder.workflow.{workflow_id}"]}},
        want=2,
    )
    by_name = {e["event"]: e for e in events}
    assert sorted(by_name) == sorted(names)

    roles = {
        name: sorted(r["prefect.resource.role"] for r in e["related"])
        for name, e in by_name.items()
    }
    # The server stores one row per related resource (plus the resource itself): 4 + 4
    # related for the two events (the archive runs in agent-workflow's archive-chat
    # task run), 5 + 5 before (a "step" role on each).
    assert roles == {
        "coder.turn.settled": ["flow", "flow-run", "task-run", "workflow"],
        "coder.chat.archived": ["flow", "flow-run", "task-run", "workflow"],
    }
    assert sum(len(e["related"]) for e in by_name.values()) == 8

    settled, archived = by_name["coder.turn.settled"], by_name["coder.chat.archived"]
    assert settled["resource"]["coder.step"] == "only"
    assert archived["resource"]["coder.step"] == "archive"
    for event in (settled, archived):
        assert event["resource"]["coder.workflow-id"] == workflow_id
        assert event["resource"]["prefect.resource.id"].startswith("coder.chat.")
        # the payload still names both, as documented
        assert event["payload"]["workflow_id"] == workflow_id
        assert event["payload"]["step"] == event["resource"]["coder.step"]

    # The step's events are still found by the step: the resource's labels.
    by_step = await _events(
        {
            "event": {"name": names},
            "resource": {"labels": {"coder.workflow-id": [workflow_id], "coder.step": ["only"]}},
        },
        want=1,
    )
    assert [e["event"] for e in by_step] == ["coder.turn.settled"]

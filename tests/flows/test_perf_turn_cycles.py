"""A finished turn leaves its agent and stream reader to be freed by reference
counting, not by the garbage collector (docs/performance.md, round 11b).

``_turn_under_lease`` handed the agent a ``before_interrupt`` callback that read
``agent.client`` through a closure over the agent: agent → callback → closure cell →
agent, a reference cycle per turn that kept the agent, its stream reader and all they
held until a collection (together with the reader's own cycle: ≈ 180 objects per turn
in a fan-out worker, promoted into the older generations whose passes they
lengthened). A real workflow run against the emulator with the collector off: no
``CoderAgent`` and no ``ChatStreamReader`` of it is left afterwards (one each on the
old code).
"""

from __future__ import annotations

import gc

from flow_helpers import say

from coder_chat.agent import CoderAgent
from coder_chat.stream import ChatStreamReader
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow


def _alive(kind: type) -> list[object]:
    return [o for o in gc.get_objects() if isinstance(o, kind)]


async def test_a_finished_turn_leaves_no_agent_for_the_collector(
    settings: WorkflowSettings, workflow_id: str, collector_off: None
) -> None:
    settings = settings.model_copy(update={"artifacts": False})
    agents, readers = len(_alive(CoderAgent)), len(_alive(ChatStreamReader))
    steps = [Step(name="one", prompt="go" + say("done"))]
    results = await agent_workflow(workflow_id, steps, settings)
    assert [r.text for r in results] == ["done"]
    assert len(_alive(CoderAgent)) == agents
    assert len(_alive(ChatStreamReader)) == readers

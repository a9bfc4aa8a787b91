"""The ``expire-approvals`` deployment: retire the chats of runs whose approval timed out.

Prefect's server fails an expired suspended run without running any code of
ours (so the workflow's ``on_failure`` hook never runs); this flow applies that
hook to such runs.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.logging import get_run_logger
from prefect.states import Failed

from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.liveness.decide import APPROVAL_EXPIRED_MESSAGE
from prefect_coder.flows.workflow.end_of_life import archive_on_failure

__all__ = ["EXPIRED_MESSAGE", "HANDLED_TAG", "expire_approvals"]

#: The message Prefect's server gives a suspended run whose timeout passed.
EXPIRED_MESSAGE = APPROVAL_EXPIRED_MESSAGE
#: Tag of the runs this flow has handled (it is idempotent).
HANDLED_TAG = "coder-approval-expired-handled"


@flow(name="expire-approvals", flow_run_name="expire-approvals")
async def expire_approvals(limit: int = 200) -> list[str]:
    """Apply the workflow failure handler to ``agent-workflow`` runs whose approval
    timed out; returns the flow-run ids handled.

    Prefect's server fails an expired suspended run without running any code of
    ours; this flow finds such runs (and suspended runs already past their
    timeout, in case the server's expiry service is off), marks them failed and
    archives their chats the way the workflow's ``on_failure`` hook would.
    Idempotent: handled runs get the tag ``coder-approval-expired-handled``.
    """
    logger = get_run_logger()
    handled: list[str] = []
    now = datetime.now(UTC)
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["agent-workflow"])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.PAUSED, StateType.FAILED])
                ),
            ),
            limit=limit,
        )
        for run in runs:
            state = run.state
            if state is None or HANDLED_TAG in (run.tags or []):
                continue
            if state.type == StateType.PAUSED:
                timeout = state.state_details.pause_timeout
                if timeout is None or timeout > now:
                    continue
                await client.set_flow_run_state(run.id, Failed(message=EXPIRED_MESSAGE), force=True)
                state = Failed(message=EXPIRED_MESSAGE)
            elif state.message != EXPIRED_MESSAGE:
                continue
            await archive_on_failure(agent_workflow, run, state)
            await client.update_flow_run(run.id, tags=[*(run.tags or []), HANDLED_TAG])
            handled.append(str(run.id))
            logger.info("approval of %s expired: failure handler applied", run.name)
    return handled

"""Prefect tasks and flows for durable Coder Agents workflows — the front door.

The public names, imported lazily from their layer (see docs/architecture.md):

* :func:`run_turn` — one durable turn (task; ``flows.turn.durable_turn``)
* :func:`model_step` — one AI Gateway call, no chat (task; ``flows.turn.model_step``)
* :func:`agent_workflow` — sequential steps on one chat (flow; ``flows.deployments.agent_workflow``)
* :func:`agent_turn` — one step as its own flow run (flow; ``flows.deployments.agent_turn``)
* :func:`archive_workflow_chat` — end of life of a workflow's chat (flow)
* :func:`recover_turn` — recover a stuck or crashed step (flow)
* :func:`sweep_orphans` — retire chats no checkpoint accounts for (flow)
* :func:`sweep_stuck_turns` — interrupt turns nobody finishes (flow)
* :func:`agent_fanout` — many workflows in parallel within the turn cap (flow)
* :func:`expire_approvals` — failure handler for timed-out approvals (flow)
* :class:`Step` (an agent turn), :class:`ModelStep`, :class:`ApprovalStep` — the kinds of step;
  :class:`WorkflowSettings`, :class:`TurnResult`, :class:`FanoutItem` — parameters and results;
  :func:`result_key` — where a step's result is stored
* :mod:`prefect_coder.tools` — register client tools and output models by name

Lazy, so that ``prefect_coder.flows.common.params`` and ``prefect_coder.tools`` stay
usable without importing Prefect's engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_coder.flows.common.params import ApprovalStep, ModelStep, Step, WorkflowSettings
    from prefect_coder.flows.common.results import TurnResult, result_key
    from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
    from prefect_coder.flows.deployments.agent_turn import agent_turn
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow
    from prefect_coder.flows.deployments.archive_workflow_chat import archive_workflow_chat
    from prefect_coder.flows.deployments.expire_approvals import expire_approvals
    from prefect_coder.flows.deployments.recover_turn import recover_turn
    from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
    from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns
    from prefect_coder.flows.turn.durable_turn import run_turn
    from prefect_coder.flows.turn.model_step import model_step

__all__ = [
    "ApprovalStep",
    "FanoutItem",
    "ModelStep",
    "Step",
    "TurnResult",
    "WorkflowSettings",
    "agent_fanout",
    "agent_turn",
    "agent_workflow",
    "archive_workflow_chat",
    "expire_approvals",
    "model_step",
    "recover_turn",
    "result_key",
    "run_turn",
    "sweep_orphans",
    "sweep_stuck_turns",
]

_LAZY = {
    "Step": "prefect_coder.flows.common.params",
    "ModelStep": "prefect_coder.flows.common.params",
    "ApprovalStep": "prefect_coder.flows.common.params",
    "WorkflowSettings": "prefect_coder.flows.common.params",
    "TurnResult": "prefect_coder.flows.common.results",
    "result_key": "prefect_coder.flows.common.results",
    "FanoutItem": "prefect_coder.flows.deployments.agent_fanout",
    "run_turn": "prefect_coder.flows.turn.durable_turn",
    "model_step": "prefect_coder.flows.turn.model_step",
    "agent_workflow": "prefect_coder.flows.deployments.agent_workflow",
    "agent_turn": "prefect_coder.flows.deployments.agent_turn",
    "archive_workflow_chat": "prefect_coder.flows.deployments.archive_workflow_chat",
    "agent_fanout": "prefect_coder.flows.deployments.agent_fanout",
    "expire_approvals": "prefect_coder.flows.deployments.expire_approvals",
    "recover_turn": "prefect_coder.flows.deployments.recover_turn",
    "sweep_orphans": "prefect_coder.flows.deployments.sweep_orphans",
    "sweep_stuck_turns": "prefect_coder.flows.deployments.sweep_stuck_turns",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefect_coder.flows' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

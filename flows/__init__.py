"""Prefect tasks and flows for durable Coder Agents workflows.

* :func:`flows.turn.run_turn` — one durable turn (task)
* :func:`flows.workflow.agent_workflow` — sequential steps on one chat (flow)
* :func:`flows.workflow.agent_turn` — one step as its own flow run (flow)
* :func:`flows.archive.archive_workflow_chat` — end of life of a workflow's chat (flow)
* :func:`flows.recovery.recover_turn` — recover a stuck or crashed step (flow)
* :func:`flows.sweeps.sweep_orphans` — retire chats no checkpoint accounts for (flow)
* :func:`flows.sweeps.sweep_stuck_turns` — interrupt turns nobody finishes (flow)
* :func:`flows.fleet.agent_fanout` — many workflows in parallel within the turn cap (flow)
* :func:`flows.model_step.model_step` — one AI Gateway call, no chat (task)
* :func:`flows.approval.expire_approvals` — failure handler for timed-out approvals (flow)
* :mod:`flows.registry` — client tools and output models by name

Submodules are imported lazily so that ``flows.params`` and ``flows.registry``
stay usable without importing Prefect's engine.
"""

from __future__ import annotations

from typing import Any

__all__ = [
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
    "run_turn",
    "sweep_orphans",
    "sweep_stuck_turns",
]

_LAZY = {
    "Step": "flows.params",
    "WorkflowSettings": "flows.params",
    "TurnResult": "flows.results",
    "run_turn": "flows.turn",
    "agent_workflow": "flows.workflow",
    "agent_turn": "flows.workflow",
    "archive_workflow_chat": "flows.archive",
    "agent_fanout": "flows.fleet",
    "model_step": "flows.model_step",
    "expire_approvals": "flows.approval",
    "recover_turn": "flows.recovery",
    "sweep_orphans": "flows.sweeps",
    "sweep_stuck_turns": "flows.sweeps",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flows' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

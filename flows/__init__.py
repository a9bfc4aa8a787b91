"""Prefect tasks and flows for durable Coder Agents workflows.

* :func:`prefect_coder.flows.turn.run_turn` — one durable turn (task)
* :func:`prefect_coder.flows.workflow.agent_workflow` — sequential steps on one chat (flow)
* :func:`prefect_coder.flows.workflow.agent_turn` — one step as its own flow run (flow)
* :func:`prefect_coder.flows.archive.archive_workflow_chat` — end of life of a workflow's chat (flow)
* :func:`prefect_coder.flows.recovery.recover_turn` — recover a stuck or crashed step (flow)
* :func:`prefect_coder.flows.sweeps.sweep_orphans` — retire chats no checkpoint accounts for (flow)
* :func:`prefect_coder.flows.sweeps.sweep_stuck_turns` — interrupt turns nobody finishes (flow)
* :func:`prefect_coder.flows.fleet.agent_fanout` — many workflows in parallel within the turn cap (flow)
* :func:`prefect_coder.flows.model_step.model_step` — one AI Gateway call, no chat (task)
* :func:`prefect_coder.flows.approval.expire_approvals` — failure handler for timed-out approvals (flow)
* :mod:`prefect_coder.flows.registry` — client tools and output models by name

Submodules are imported lazily so that ``prefect_coder.flows.params`` and ``prefect_coder.flows.registry``
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
    "Step": "prefect_coder.flows.params",
    "WorkflowSettings": "prefect_coder.flows.params",
    "TurnResult": "prefect_coder.flows.results",
    "run_turn": "prefect_coder.flows.turn",
    "agent_workflow": "prefect_coder.flows.workflow",
    "agent_turn": "prefect_coder.flows.workflow",
    "archive_workflow_chat": "prefect_coder.flows.archive",
    "agent_fanout": "prefect_coder.flows.fleet",
    "model_step": "prefect_coder.flows.model_step",
    "expire_approvals": "prefect_coder.flows.approval",
    "recover_turn": "prefect_coder.flows.recovery",
    "sweep_orphans": "prefect_coder.flows.sweeps",
    "sweep_stuck_turns": "prefect_coder.flows.sweeps",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flows' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

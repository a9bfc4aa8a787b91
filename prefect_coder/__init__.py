"""prefect-coder: durable Coder Agents workflows on Prefect 3 — the front door.

The public names, each also in its own public module:

* blocks (:mod:`prefect_coder.blocks`): :class:`CoderCredentials`, :class:`ChatStateStore`;
* tools (:mod:`prefect_coder.tools`): :func:`registered_tool`, :func:`output_model`,
  :class:`ToolContext`;
* parameters and results: :class:`Step` (an agent turn), :class:`ModelStep`,
  :class:`ApprovalStep`, :class:`WorkflowSettings`, :class:`TurnResult`;
* flows and tasks (:mod:`prefect_coder.flows`): :func:`agent_workflow`,
  :func:`agent_turn`, :func:`agent_fanout`, :func:`recover_turn`, :func:`run_turn`,
  :func:`model_step`, the sweeps;
* errors (:mod:`prefect_coder.errors`): :class:`PrefectCoderError` and every error the
  product raises.

:mod:`coder_chat` is the Prefect-free chatd client, its own top-level package.

This module is also the ``prefect.collections`` entry point: Prefect imports it in
every process of the environment, so it imports only the blocks (which registers
their types) and everything else on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefect_coder.blocks import ChatStateStore, CoderCredentials

if TYPE_CHECKING:
    from prefect_coder.errors import PrefectCoderError
    from prefect_coder.flows import (
        ApprovalStep,
        ModelStep,
        Step,
        TurnResult,
        WorkflowSettings,
        agent_fanout,
        agent_turn,
        agent_workflow,
        archive_workflow_chat,
        expire_approvals,
        model_step,
        recover_turn,
        run_turn,
        sweep_orphans,
        sweep_stuck_turns,
    )
    from prefect_coder.tools import ToolContext, output_model, registered_tool

_LAZY = {
    "PrefectCoderError": "prefect_coder.errors",
    "ToolContext": "prefect_coder.tools",
    "output_model": "prefect_coder.tools",
    "registered_tool": "prefect_coder.tools",
    **{
        name: "prefect_coder.flows"
        for name in (
            "ApprovalStep",
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
            "run_turn",
            "sweep_orphans",
            "sweep_stuck_turns",
        )
    },
}

__all__ = [
    "ApprovalStep",
    "ChatStateStore",
    "CoderCredentials",
    "ModelStep",
    "PrefectCoderError",
    "Step",
    "ToolContext",
    "TurnResult",
    "WorkflowSettings",
    "agent_fanout",
    "agent_turn",
    "agent_workflow",
    "archive_workflow_chat",
    "expire_approvals",
    "model_step",
    "output_model",
    "recover_turn",
    "registered_tool",
    "run_turn",
    "sweep_orphans",
    "sweep_stuck_turns",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefect_coder' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

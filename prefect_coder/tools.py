"""Register the client tools and output models your workflow steps name.

A deployment parameter is JSON, so a step names its tools (``Step.tools``) and its
structured-output model (``Step.output_model``); the worker resolves each name in
this registry. Put the registrations in a *tool module* and list it in
``WorkflowSettings.tool_modules``, in ``PREFECT_CODER_TOOL_MODULES``, or in your
package's ``prefect_coder.tools`` entry-point group (docs/deploy.md, "Your tools")::

    from pydantic import BaseModel

    from prefect_coder.tools import ToolContext, output_model, registered_tool


    class Args(BaseModel):
        build_id: str


    @registered_tool(name="lookup_build", description="Fetch a CI build's status.", pure=True)
    async def lookup_build(args: Args, ctx: ToolContext) -> dict:
        ...


    @output_model("fix_plan")
    class FixPlan(BaseModel):
        summary: str

Every registered tool runs behind the write-ahead tool ledger in a durable workflow
(``ctx.idempotency_key`` stays the same when recovery re-drives a call);
``pure=True`` declares a side-effect-free tool that recovery may simply run again.

A tool that raises tells the model only that it failed, with an error id the run's
log explains (its exception text may hold hosts, paths or credentials); raise
:class:`ToolError` with a message meant for the model to pass that message on.
"""

from __future__ import annotations

from coder_chat.tools import ClientTool, ToolContext, ToolError
from prefect_coder.flows.common.registry import (
    TOOL_MODULES_ENV,
    TOOLS_ENTRY_POINT_GROUP,
    output_model,
    register_output_model,
    register_tool,
    registered_tool,
)

__all__ = [
    "TOOLS_ENTRY_POINT_GROUP",
    "TOOL_MODULES_ENV",
    "ClientTool",
    "ToolContext",
    "ToolError",
    "output_model",
    "register_output_model",
    "register_tool",
    "registered_tool",
]

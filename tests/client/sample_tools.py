"""A plain client tool the agent tests share (imported as a module, not via conftest)."""

from __future__ import annotations

from pydantic import BaseModel

from coder_chat import ToolContext, client_tool

__all__ = ["Add", "add"]


class Add(BaseModel):
    """Arguments of ``add``."""

    a: int
    b: int


@client_tool(description="Add two integers")
async def add(args: Add, ctx: ToolContext) -> int:
    """The sum: no side effect, so any test may run it any number of times."""
    return args.a + args.b

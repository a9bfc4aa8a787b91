"""Demo client tools and output models, registered by name at import.

``WorkflowSettings.tool_modules`` lists this module by default, so a deployment
can name ``lookup_build``, ``record_note`` and the ``fix_plan`` output model
without any code. They are deterministic and touch nothing outside the process.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, Field

from coder_chat.tools import ToolContext
from prefect_coder.tools import output_model, registered_tool

__all__ = ["BuildQuery", "FixPlan", "Note", "lookup_build", "record_note"]


class BuildQuery(BaseModel):
    """Arguments of ``lookup_build``."""

    build_id: str = Field(description="CI build identifier, e.g. 'nightly-1042'.")


class Note(BaseModel):
    """Arguments of ``record_note``."""

    title: str
    body: str


@registered_tool(
    name="lookup_build",
    description="Look up a CI build: its status, the failing test and a log excerpt.",
    pure=True,  # a lookup: no ledger; recovery may simply run it again
)
async def lookup_build(args: BuildQuery, ctx: ToolContext) -> dict[str, object]:
    """A canned CI answer derived from the build id (deterministic for tests)."""
    seed = int(hashlib.sha256(args.build_id.encode()).hexdigest()[:6], 16)
    return {
        "build_id": args.build_id,
        "status": "failed",
        "failing_test": "tests/test_dates.py::test_parse_iso_week",
        "log_excerpt": f"AssertionError: week {seed % 52 + 1} parsed as {seed % 52}",
    }


@registered_tool(name="record_note", description="Record a short note for the humans.")
async def record_note(args: Note, ctx: ToolContext) -> dict[str, object]:
    """Acknowledge a note, keyed by the call's idempotency key.

    Not declared pure, so it runs behind the tool ledger like any effectful tool:
    ``ctx.idempotency_key`` is the ledger key (tenant/chat/call), stable across a
    crash and its recovery."""
    return {"recorded": True, "key": ctx.idempotency_key, "words": len(args.body.split())}


@output_model("fix_plan")
class FixPlan(BaseModel):
    """A structured fix proposal."""

    summary: str
    files: list[str] = Field(default_factory=list)
    risk: Literal["low", "medium", "high"] = "low"

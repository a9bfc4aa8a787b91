"""The persisted result of one turn, and the stable key it is stored under.

A finished step's result is stored by Prefect's result persistence under a key
derived from (workflow id, step name) only — never from the flow-run id — so a
re-run of the same workflow (a flow retry, a new flow run, another worker)
finds it and returns it without sending anything to the chat. JSON, not
pickle: the record is readable with ``cat`` and portable across versions.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from pydantic import BaseModel, Field

__all__ = ["ToolCallRecord", "TurnResult", "result_key", "turn_cache_key"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class ToolCallRecord(BaseModel):
    """One tool call of the turn, client- or server-executed."""

    id: str | None = None
    name: str
    kind: str = Field(description="'client' (ran in this process) or 'server'.")
    args: Any = None
    output: Any = None
    is_error: bool = False


class TurnResult(BaseModel):
    """What a step returns (and what a re-run returns from storage)."""

    workflow_id: str
    step: str
    marker: str
    chat_id: str
    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] = Field(default_factory=dict)
    user_message_id: int | None = None
    message_ids: list[int] = Field(default_factory=list)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    structured: dict[str, Any] | None = None
    attempt: int = 1
    generate_ms: float = Field(0.0, description="Wall time spent inside generate().")


def result_key(workflow_id: str, step_name: str, *, kind: str = "turn") -> str:
    """Storage key of a step's ``kind`` result (``turn``, ``model``, ``approval``):
    readable, filesystem- and lock-safe, unique.

    Lock keys may not contain "/" and ids may contain ':' or '@', so unsafe
    characters are replaced and a short hash of the exact pair keeps distinct
    pairs apart.
    """
    digest = hashlib.sha256(f"{workflow_id}\x00{step_name}".encode()).hexdigest()[:12]
    safe_id, safe_step = _UNSAFE.sub("_", workflow_id), _UNSAFE.sub("_", step_name)
    return f"coder-{kind}-{safe_id}--{safe_step}-{digest}"


def turn_cache_key(_context: object, parameters: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn`` of ``run_turn``: the step's stable result key."""
    step = parameters["step"]
    name = step["name"] if isinstance(step, dict) else step.name
    return result_key(str(parameters["workflow_id"]), str(name))

"""One markdown artifact per turn: prompt, answer, tool calls, usage.

Rendering is pure (:func:`render_turn_markdown`); publishing is one API call.
The artifact key is stable per (workflow, step), so the UI shows a step's
latest attempt with its history of versions.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from prefect.artifacts import MarkdownArtifact
from prefect.utilities.context import get_task_and_flow_run_ids

from prefect_coder.flows.observe.background import defer

if TYPE_CHECKING:
    # Type-only: observe sits below common (common.resources wires the observers).
    from prefect_coder.flows.common.results import TurnResult

__all__ = ["artifact_key", "chat_web_url", "publish_turn_artifact", "render_turn_markdown"]

_NOT_KEY = re.compile(r"[^a-z0-9-]+")


def artifact_key(
    workflow_id: str, step_name: str, *, kind: str = "turn", slug_len: int = 80
) -> str:
    """The stable key of a step's ``kind`` artifact (``coder-<kind>-<slug>-<digest>``):
    Prefect artifact keys allow lowercase letters, digits and dashes only."""
    digest = hashlib.sha256(f"{workflow_id}\x00{step_name}".encode()).hexdigest()[:8]
    slug = _NOT_KEY.sub("-", f"{workflow_id}-{step_name}".lower()).strip("-")[:slug_len]
    return f"coder-{kind}-{slug}-{digest}"


def chat_web_url(base_url: str | None, chat_id: str | None) -> str | None:
    """The chat's page in the Coder web UI (``/agents/<chat id>``, the route of
    coder/coder's ``site/src/router.tsx``), or ``None`` without a base URL or chat.

    Built from the deployment's base URL only: it never carries the token."""
    if not base_url or not chat_id:
        return None
    return f"{base_url.rstrip('/')}/agents/{chat_id}"


def _fence(text: str) -> str:
    # A fence longer than any backtick run inside keeps model output from
    # closing the block early and rendering as page markup.
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def table_cell(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_turn_markdown(result: TurnResult, prompt: str, *, base_url: str | None = None) -> str:
    """Markdown for one finished turn; with ``base_url`` the chat links to its
    page in the Coder web UI."""
    url = chat_web_url(base_url, result.chat_id)
    # A plain link: code spans inside link text render as literal backticks in the UI.
    chat = f"[{result.chat_id}]({url})" if url else f"`{result.chat_id}`"
    lines = [
        f"# Turn `{result.step}` of workflow `{result.workflow_id}`",
        "",
        f"- chat: {chat}",
        f"- finish reason: `{result.finish_reason}`",
        f"- attempt: {result.attempt}",
        f"- generate time: {result.generate_ms:.0f} ms",
        "",
        "## Prompt",
        "",
        _fence(prompt),
        "",
        "## Answer",
        "",
        _fence(result.text),
        "",
    ]
    if result.structured is not None:
        lines += [
            "## Structured output",
            "",
            f"```json\n{json.dumps(result.structured, indent=2)}\n```",
            "",
        ]
    lines += ["## Tool calls", ""]
    if result.tool_calls:
        lines += ["| tool | runs on | input | output |", "|---|---|---|---|"]
        for call in result.tool_calls:
            output = (
                f"error: {table_cell(call.output)}" if call.is_error else table_cell(call.output)
            )
            lines.append(
                f"| `{table_cell(call.name)}` | {call.kind} | {table_cell(call.args)} | {output} |"
            )
    else:
        lines.append("none")
    lines += ["", "## Usage", ""]
    if result.usage:
        lines += ["| counter | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in result.usage.items() if v is not None]
    else:
        lines.append("not reported")
    return "\n".join(lines) + "\n"


def publish_turn_artifact(result: TurnResult, prompt: str, *, base_url: str | None = None) -> None:
    """Create the turn's markdown artifact for the current task run, in this loop's
    next background batch (see :mod:`prefect_coder.flows.observe.background`): the
    rendering and the API call both happen off the turn's path."""
    task_run_id, flow_run_id = get_task_and_flow_run_ids()

    def create() -> Awaitable[Any]:
        return MarkdownArtifact(
            key=artifact_key(result.workflow_id, result.step),
            description=f"Coder turn {result.workflow_id}/{result.step}",
            markdown=render_turn_markdown(result, prompt, base_url=base_url),
            task_run_id=task_run_id,
            flow_run_id=flow_run_id,
        ).acreate()

    defer(create, name=f"artifact {result.workflow_id}/{result.step}")

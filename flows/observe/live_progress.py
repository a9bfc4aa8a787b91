"""Live progress of a running turn: one markdown artifact, updated at a bounded rate.

A real turn runs for minutes and its finished-turn artifact
(:mod:`prefect_coder.flows.observe.artifacts`) appears only at the end. While the
turn runs, :class:`LiveProgress` keeps a small picture of it — the text streamed
so far (its tail), each tool call and its state, retries and redials, the chat's
status — and publishes it as one markdown artifact of the task run, created once
and then updated in place.

The hot path only updates a few fields per transport event (no rendering, no
I/O, nothing awaited). Publishing runs in one background task that wakes at most
once per ``interval_s`` (``PREFECT_CODER_PROGRESS_INTERVAL_S``, default 2 s)
when something changed. The first publish waits one interval from the turn's
start: a turn shorter than that gets no live artifact at all (its finished-turn
artifact says everything), which spares short turns two API calls — the largest
CPU item per turn in ``bench/durable.py``'s profile. Once a live artifact exists,
:meth:`LiveProgress.finish` always publishes the last state. A failed publish is
logged at debug and never touches the turn.

Nothing here sees the token: the picture is built from stream events (model
text, tool names and arguments, statuses) and the deployment's base URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.utilities.context import get_task_and_flow_run_ids

from coder_chat.core.fields import field
from coder_chat.events import SegmentSettle, TransportEvent, WsEvent, WsRedial
from prefect_coder.flows.observe.artifacts import artifact_key, chat_web_url
from prefect_coder.flows.observe.background import spawn

__all__ = ["INTERVAL_ENV", "LiveProgress", "ToolState", "progress_interval_s"]

#: Environment variable: the least time between two updates of a live artifact.
INTERVAL_ENV = "PREFECT_CODER_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 2.0

_log = logging.getLogger(__name__)


def progress_interval_s() -> float:
    """The update interval from ``PREFECT_CODER_PROGRESS_INTERVAL_S`` (default 2 s)."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


@dataclass(slots=True)
class ToolState:
    """One tool call as the live view shows it."""

    name: str
    runs_on: str
    state: str
    args: str = ""


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class LiveProgress:
    """The live view of one turn; call it with every transport event of the turn."""

    def __init__(
        self,
        *,
        workflow_id: str,
        step: str,
        base_url: str | None = None,
        interval_s: float | None = None,
        note: str | None = None,
        text_tail: int = 4000,
    ) -> None:
        self.workflow_id = workflow_id
        self.step = step
        self.base_url = base_url
        self.interval_s = progress_interval_s() if interval_s is None else interval_s
        self.text_tail = text_tail
        self.chat_id: str | None = None
        self.chat_status: str | None = None
        self.outcome: str | None = None
        self.notes: list[str] = [note] if note else []
        self.text = ""
        self.text_chars = 0
        #: Text streamed since the last committed assistant message.
        self._message_text = ""
        self.tools: dict[str, ToolState] = {}
        self.retries = 0
        self.redials = 0
        self.segments = 0
        self.updates = 0  # published versions of the artifact, the final one included
        self.started = time.monotonic()
        self._changed = False
        self._finished = False
        # The first publish waits one interval from the start (see the module doc).
        self._last_publish = self.started
        self._artifact_id: UUID | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._run_ids = get_task_and_flow_run_ids()

    # ---------------------------------------------------------------- hot path

    def __call__(self, ev: TransportEvent) -> None:
        """Fold one event into the picture; schedules a publish, never awaits."""
        if self._finished:
            return
        chat_id = getattr(ev, "chat_id", None)
        if chat_id:
            self.chat_id = chat_id
        if isinstance(ev, WsEvent):
            if not ev.forwarded:
                return  # a replayed delta the turn already counted
            if not self._fold(ev.event):
                return
        elif isinstance(ev, WsRedial):
            self.redials += 1
        elif isinstance(ev, SegmentSettle):
            self.segments += 1
        else:
            return
        self._changed = True
        self._schedule()

    def _fold(self, event: Any) -> bool:
        etype = field(event, "type")
        if etype == "message_part":
            part = field(field(event, "message_part"), "part")
            ptype = field(part, "type")
            if ptype == "text":
                self._append(str(field(part, "text", "") or ""))
                return True
            if ptype in ("tool-call", "tool-result"):
                call_id = field(part, "tool_call_id")
                name = field(part, "tool_name")
                if not isinstance(call_id, str):
                    return False
                tool = self.tools.get(call_id)
                if tool is None:
                    # Provider-executed calls run on the server; the others are
                    # client tools this turn answers after action_required.
                    server = bool(field(part, "provider_executed"))
                    tool = self.tools[call_id] = ToolState(
                        str(name),
                        "server" if server else "client",
                        "running" if server else "called",
                    )
                if ptype == "tool-call" and field(part, "args") is not None:
                    tool.args = _short(field(part, "args"))
                if ptype == "tool-result":
                    tool.state = "error" if field(part, "is_error") else "done"
                return True
            return False
        if etype == "message":
            return self._fold_committed(field(event, "message"))
        if etype == "status":
            status = field(field(event, "status"), "status")
            if isinstance(status, str) and status != self.chat_status:
                self.chat_status = status
                if status != "requires_action":
                    # The server took the submitted results and generates again.
                    for tool in self.tools.values():
                        if tool.state == "awaiting result":
                            tool.state = "answered"
                return True
            return False
        if etype == "action_required":
            for call in field(field(event, "action_required"), "tool_calls", []) or []:
                call_id = field(call, "tool_call_id")
                if not isinstance(call_id, str):
                    continue
                known = self.tools.get(call_id)
                if known is None:
                    self.tools[call_id] = ToolState(
                        str(field(call, "tool_name")),
                        "client",
                        "awaiting result",
                        _short(field(call, "args", "")),
                    )
                elif known.state in ("called", "running"):
                    known.runs_on, known.state = "client", "awaiting result"
            return True
        if etype == "retry":
            self.retries += 1
            self.notes.append(f"model retry {self.retries}: {_short(field(event, 'retry'))}")
            return True
        if etype == "error":
            self.notes.append(f"error: {_short(field(event, 'error'))}")
            return True
        return False

    def _fold_committed(self, message: Any) -> bool:
        """A committed assistant message: the text it has beyond what streamed of it.

        A stream dialed (or redialed) after the server committed a message gets the
        message, not its deltas: on a loaded machine the whole first answer of a turn
        arrived so, and the live view showed none of its text."""
        if field(message, "role") != "assistant":
            return False
        text = ""
        changed = False
        for part in field(message, "content", []) or []:
            ptype = field(part, "type")
            if ptype == "text":
                text += str(field(part, "text", "") or "")
            elif ptype == "tool-call":
                call_id = field(part, "tool_call_id")
                if isinstance(call_id, str) and call_id not in self.tools:
                    server = bool(field(part, "provider_executed"))
                    self.tools[call_id] = ToolState(
                        str(field(part, "tool_name")),
                        "server" if server else "client",
                        "running" if server else "called",
                        _short(field(part, "args", "")),
                    )
                    changed = True
        streamed, self._message_text = self._message_text, ""
        if text.startswith(streamed) and len(text) > len(streamed):
            self._append(text[len(streamed) :])
            self._message_text = ""
            changed = True
        return changed

    def _append(self, delta: str) -> None:
        self._message_text += delta
        self.text_chars += len(delta)
        self.text += delta
        if len(self.text) > 2 * self.text_tail:
            # Amortised trim: the view shows only the tail.
            self.text = self.text[-self.text_tail :]

    def _schedule(self) -> None:
        if self._publisher is None or self._publisher.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # an event from a thread without a loop
                return
            self._publisher = loop.create_task(self._publish_later(), name="live progress")

    # ---------------------------------------------------------------- publishing

    async def _publish_later(self) -> None:
        # Loops while events keep coming: those that arrive during a publish
        # only mark the picture changed (the task is not done yet).
        while self._changed and not self._finished:
            wait = self._last_publish + self.interval_s - time.monotonic()
            if wait > 0:
                # finish() wakes the sleeper; a publish already on the wire is never
                # cancelled (its artifact id would be lost and a second one created).
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
            if self._finished:
                return
            await self._publish()

    async def _publish(self) -> None:
        self._changed = False
        self._last_publish = time.monotonic()
        markdown = self.render()
        try:
            async with get_client() as client:
                if self._artifact_id is None:
                    task_run_id, flow_run_id = self._run_ids
                    created = await client.create_artifact(
                        ArtifactCreate(
                            # Keyed, so the card has a title in the UI and a rerun of
                            # the step adds a version instead of another untitled card.
                            key=artifact_key(self.workflow_id, self.step, kind="live"),
                            type="markdown",
                            description=f"Live progress of Coder turn {self.workflow_id}/{self.step}",
                            data=markdown,
                            task_run_id=task_run_id,
                            flow_run_id=flow_run_id,
                        )
                    )
                    self._artifact_id = created.id
                else:
                    await client.update_artifact(self._artifact_id, ArtifactUpdate(data=markdown))
            self.updates += 1
        except Exception:  # observability must never break a turn
            _log.debug("could not publish live progress", exc_info=True)

    def finish(self, outcome: str) -> None:
        """The turn ended: publish the final state in the background (drained at
        the end of the flow) and ignore later events."""
        if self._finished:
            return
        self.outcome = outcome
        self._finished = True
        spawn(self._final(), name=f"live progress {self.workflow_id}/{self.step}")

    async def _final(self) -> None:
        publisher = self._publisher
        if publisher is not None and not publisher.done():
            self._wake.set()
            await asyncio.wait([publisher])  # never raises
        if self._artifact_id is None and self.updates == 0:
            return  # never shown live (or its create failed): nothing to finish
        await self._publish()

    # ---------------------------------------------------------------- rendering

    def render(self) -> str:
        """The current picture as markdown."""
        elapsed = time.monotonic() - self.started
        state = f"finished — {self.outcome}" if self.outcome else "running"
        url = chat_web_url(self.base_url, self.chat_id)
        # A plain link: code spans inside link text render as literal backticks in the UI.
        chat = f"[{self.chat_id}]({url})" if url else f"`{self.chat_id or 'not created yet'}`"
        lines = [
            f"# Live: turn `{self.step}` of workflow `{self.workflow_id}`",
            "",
            f"- state: **{state}** after {elapsed:.0f} s",
            f"- chat: {chat}, status `{self.chat_status or '-'}`",
            f"- segments: {self.segments}, model retries: {self.retries}, "
            f"stream redials: {self.redials}",
            "",
            "## Tool calls",
            "",
        ]
        if self.tools:
            lines += ["| tool | runs on | state | input |", "|---|---|---|---|"]
            lines += [
                f"| `{_short(t.name)}` | {t.runs_on} | {t.state} | {t.args} |"
                for t in self.tools.values()
            ]
        else:
            lines.append("none yet")
        lines += ["", f"## Streamed text ({self.text_chars} characters)", ""]
        text = self.text[-self.text_tail :]
        if len(text) < self.text_chars:
            text = "…" + text
        # A fence longer than any backtick run inside keeps model text from
        # closing the block early and rendering as page markup.
        longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
        fence = "`" * max(3, longest + 1)
        lines += [f"{fence}text", text, fence]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {_short(n, 200)}" for n in self.notes[-20:]]
        lines += ["", f"_update {self.updates + 1}, at most one per {self.interval_s:g} s_"]
        return "\n".join(lines) + "\n"

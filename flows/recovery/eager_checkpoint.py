"""Checkpoint a first turn's chat as soon as its stream dials.

It shrinks the orphan window of a first turn: a crash after the chat was
created but before the turn's ``finally`` checkpoint would otherwise leave a
chat nobody can find. Crash-safe tools await it before any effect, so no
client-tool effect can ever run on a chat nobody can find after a crash.

Test seam: :func:`coder_chat.crash_safe.crash_point` names points (``turn.*``)
where the crash-matrix tests SIGKILL the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from coder_chat.crash_safe import crash_point
from coder_chat.events import HttpRequest, HttpResponse, TransportEvent, WsDial, WsEvent
from coder_chat.tools import ToolContext
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry

__all__ = ["EagerCheckpoint"]


class EagerCheckpoint:
    """Checkpoint a first turn's chat as soon as its id is known.

    A hard crash after the chat was created but before the ``finally``
    checkpoint leaves a chat nobody can resume — and, if the crash hit a client
    tool, an effect recorded under a chat id nobody knows. So the chat id (and
    the first send's ``"submitting"`` journal entry, which the send had no chat
    to be written under) is made durable from the first ``ws:dial`` event, and
    every crash-safe tool awaits :meth:`ensure` before its write-ahead.

    Also the transport hook of the turn's named crash points (test seam).
    """

    def __init__(
        self,
        store: StateStore,
        workflow_id: str,
        marker: str,
        *,
        had_chat: bool,
        started_at: float | None = None,
        turn_timeout: float | None = None,
    ) -> None:
        self.store = store
        self.workflow_id = workflow_id
        self.marker = marker
        self._had_chat = had_chat
        self.started_at = started_at or time.time()
        #: The step's turn timeout: the first send's journal entry records
        #: ``started_at`` + it as the attempt's deadline (None: none recorded).
        self.turn_timeout = turn_timeout
        self.written: str | None = None
        self._streamed = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def had_chat(self) -> bool:
        """The turn's chat was the checkpoint before its send: nothing to checkpoint."""
        return self._had_chat

    def moved(self, *, checkpointed: bool) -> None:
        """The turn moved to another chat before its send: an adopted one, already the
        checkpoint (``checkpointed``), or a fresh one its send creates — checkpointed
        here as a first turn's is, because the archived chat it leaves is one no
        longer."""
        self._had_chat = checkpointed

    async def ensure(self, chat_id: str) -> None:
        """Make ``chat_id`` the workflow's checkpoint (first turn only; idempotent)."""
        if self.had_chat or self.written == chat_id:
            return
        async with self._lock:
            if self.written == chat_id:
                return
            # The checkpoint and the first send's write-ahead, late (the count before it
            # was 0), in one transaction and one trip (store.turns.record).
            await self.store.turns.record(
                self.workflow_id,
                chat_id,
                None,
                journal=JournalEntry.submitting(
                    self.marker, 0, turn_timeout=self.turn_timeout, at=self.started_at
                ),
            )
            self.written = chat_id
        crash_point("turn.after_checkpoint")

    async def before_effect(self, ctx: ToolContext) -> None:
        """``before_effect`` of crash-safe tools: the chat must be findable first."""
        await self.ensure(ctx.chat_id)

    def chain(self, inner: Callable[[TransportEvent], object] | None) -> Callable[..., None]:
        """A transport hook: this one first, then ``inner``."""

        def hook(ev: TransportEvent) -> None:
            self(ev)
            if inner is not None:
                inner(ev)

        return hook

    def __call__(self, ev: TransportEvent) -> None:
        if isinstance(ev, HttpRequest) and ev.op == "createChat":
            crash_point("turn.before_create")
        elif isinstance(ev, HttpRequest) and ev.op == "createChatMessage":
            # the send write-ahead is journaled; the request is about to leave
            crash_point("turn.sending")
        elif isinstance(ev, HttpResponse) and ev.op == "createChat" and ev.ok:
            crash_point("turn.after_create")
        elif isinstance(ev, HttpResponse) and ev.op == "submitToolResults" and ev.ok:
            # the tool round's results landed; the model continues server-side
            crash_point("turn.after_tool_results")
        elif isinstance(ev, WsDial) and not self.had_chat and self.written != ev.chat_id:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to do
                task = asyncio.get_running_loop().create_task(self.ensure(ev.chat_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        elif isinstance(ev, WsEvent) and not self._streamed and (self.had_chat or self.written):
            if getattr(ev.event, "type", None) == "message_part":
                self._streamed = True  # once per turn: the first streamed part
                crash_point("turn.mid_stream")

    async def drain(self) -> None:
        """Wait for scheduled checkpoint writes (call before the ``finally`` checkpoint)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

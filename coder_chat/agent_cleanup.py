# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""What the agent sends when a turn is cut short or a session ends.

* :class:`BackgroundStops`: the fire-and-forget requests a segment's teardown
  asks for — a best-effort interrupt of the turn's own chat (after the caller's
  ``before_interrupt`` hook) or the withdrawal of a still-queued prompt — and
  waiting for them (``wait_background()``, ``aclose()``).
* :func:`archive_targets`: stop and archive the stranded chats and the session's
  chat within one shared window (:meth:`CoderAgent.archive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from coder_chat.agent_options import AgentHooks, AgentTimings
from coder_chat.agent_session import AgentSession
from coder_chat.errors import CoderChatError
from coder_chat.rest import ChatClient
from coder_chat.results import ArchiveResult
from coder_chat.stop import stop_chat

__all__ = ["BackgroundStops", "archive_targets"]

_log = logging.getLogger("coder_chat.agent")


class BackgroundStops:
    """Best-effort interrupts and queue withdrawals, off the turn's critical path."""

    def __init__(self, client: ChatClient, timings: AgentTimings, hooks: AgentHooks) -> None:
        self._client = client
        self._timings = timings
        self._hooks = hooks
        self._tasks: set[asyncio.Task[Any]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fire_interrupt(self, chat_id: str) -> None:
        """Best-effort, fire-and-forget interrupt of this turn's own chat."""

        async def run() -> None:
            if not await self.journal_interrupt(chat_id):
                return
            with contextlib.suppress(Exception):
                await self._client.interrupt_chat(chat_id, timeout=self._timings.interrupt)

        self._spawn(run())

    async def journal_interrupt(self, chat_id: str) -> bool:
        """Run ``before_interrupt``; False (do not interrupt) when it failed."""
        before_interrupt = self._hooks.before_interrupt
        if before_interrupt is None:
            return True
        try:
            await before_interrupt(chat_id)
        except Exception as exc:
            _log.warning(
                "before_interrupt failed (%s): chat %s is left for recovery",
                type(exc).__name__,
                chat_id,
            )
            return False
        return True

    def fire_withdraw(self, chat_id: str, queued_id: int) -> None:
        """A still-queued prompt is withdrawn, never left to run unattended."""

        async def run() -> None:
            with contextlib.suppress(Exception):
                await self._client.delete_queued_message(
                    chat_id, queued_id, timeout=self._timings.interrupt
                )

        self._spawn(run())

    async def wait(self, timeout: float | None) -> None:
        """Wait for the requests in flight (bounded)."""
        tasks = set(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


async def archive_targets(
    client: ChatClient,
    session: AgentSession,
    timings: AgentTimings,
    primary: str | None,
    targets: list[str],
) -> ArchiveResult:
    """Stop and archive ``targets`` in order within one ``settle_deadline`` window;
    each success leaves ``session.stranded`` and ``last_known_chat_id``."""
    loop = asyncio.get_running_loop()
    t = timings
    deadline = loop.time() + t.settle_deadline
    archived: list[str] = []
    for target in targets:
        stopped = await stop_chat(
            client,
            target,
            timeout=max(0.001, deadline - loop.time()),
            archive=True,
            poll_interval=t.settle_retry_delay,
        )
        if not stopped.archived:
            why = f"; last error: {stopped.last_error}" if stopped.last_error else ""
            raise CoderChatError(
                f"chat {target} was not archived within the {t.settle_deadline:g}s window "
                f"(last status {stopped.status}){why}",
                kind="archive_incomplete",
                retryable=True,
            )
        archived.append(target)
        session.stranded.pop(target, None)
        if session.last_known_chat_id == target:
            session.last_known_chat_id = None
    return ArchiveResult(True, primary, archived)

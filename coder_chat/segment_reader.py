"""Reading one segment's stream events into its translator until the run settles.

The I/O half of a segment's read phase (agent-semantics §3.5): the translator
decides what each event means and when the segment is over; this loop only
moves events, runs the lost-``action_required`` recovery beside the stream,
and picks up the second half of a ``status: error`` + ``error`` pair that
arrives in the same frame.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from coder_chat.core.translator import TurnTranslator
from coder_chat.models import ChatStreamEvent
from coder_chat.stream import ChatStreamReader

__all__ = ["FetchPending", "read_until_settled"]

#: ``fetch_pending(after_id)`` → ``(turn_messages, calls)`` or ``None`` (keep waiting).
FetchPending = Callable[[int], Coroutine[Any, Any, tuple[list[Any], list[dict[str, Any]]] | None]]


class _SideDone:
    """Sentinel: a side task finished before the next stream event."""


_SIDE_DONE = _SideDone()


async def read_until_settled(
    reader: ChatStreamReader,
    tr: TurnTranslator,
    *,
    action_grace: float,
    fetch_pending: FetchPending,
) -> None:
    """Feed ``tr`` from ``reader`` until the segment settles or the reader closes.

    While the run sits in ``requires_action`` with no client call seen, one
    ``action_grace`` timer runs for the whole wait; on expiry (once per wait)
    ``fetch_pending(effective_cursor)`` reads the pending calls from history,
    racing the stream (a late real event still wins). Returns normally when
    the reader was closed by us; the caller tells a settle from a close.
    """
    loop = asyncio.get_running_loop()
    grace_until: float | None = None
    recovery: asyncio.Task[Any] | None = None
    recovered = False
    try:
        while not tr.settled:
            if tr.awaiting_action:
                if grace_until is None:
                    grace_until = loop.time() + action_grace
                if recovery is None and not recovered and loop.time() >= grace_until:
                    recovery = loop.create_task(fetch_pending(tr.effective_cursor))
            else:
                # Re-armed once the run leaves requires_action.
                grace_until, recovered = None, False
                if recovery is not None:
                    recovery.cancel()
                    recovery = None
            wait: float | None = None
            if tr.awaiting_action and recovery is None and not recovered and grace_until:
                wait = max(0.0, grace_until - loop.time())
            # Fast path: take an already-arrived event without suspending.
            item: ChatStreamEvent | _SideDone | None = (
                reader.next_event_nowait() if recovery is None else None
            )
            if item is None:
                item = await _next(reader, wait, recovery)
            if item is _SIDE_DONE:
                assert recovery is not None
                found = None
                with contextlib.suppress(Exception):
                    found = recovery.result()
                recovery, recovered = None, True
                if found and tr.awaiting_action:
                    turn_messages, calls = found
                    tr.ingest_recovered(turn_messages, calls)
                continue
            if item is None:
                if wait is not None:
                    continue  # grace expired: loop to start the recovery
                return  # closed by us
            assert isinstance(item, ChatStreamEvent)
            tr.feed(item)
        if (tr.error is None) != (tr.terminal_status != "error"):
            # chatd sends `status: error` then the `error` event in one sync (one
            # frame): pick up the other half without waiting, so the turn raises
            # the server's error instead of finishing quietly with reason "error".
            while True:
                try:
                    ev = await reader.next_event(timeout=0)
                except TimeoutError:
                    break
                if ev is None:
                    break
                tr.feed(ev)
                if tr.error is not None and tr.terminal_status == "error":
                    break
    finally:
        if recovery is not None:
            recovery.cancel()


async def _next(
    reader: ChatStreamReader,
    wait: float | None,
    side: asyncio.Task[Any] | None,
) -> ChatStreamEvent | _SideDone | None:
    """Next stream event; ``None`` on a grace expiry (or closed reader);
    ``_SIDE_DONE`` when ``side`` finished first. Never loses an event."""
    if side is None:
        try:
            return await reader.next_event(timeout=wait)
        except TimeoutError:
            if wait is None:
                raise
            return None
    if side.done():
        return _SIDE_DONE
    read = asyncio.ensure_future(reader.next_event())
    try:
        done, _ = await asyncio.wait({read, side}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        read.cancel()
        raise
    if read in done:
        return read.result()
    read.cancel()
    try:
        return await read  # it may have completed before the cancel landed
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        return _SIDE_DONE

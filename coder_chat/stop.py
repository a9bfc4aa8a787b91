"""Bring a chat to rest: the one way to stop (and optionally archive) a chat.

Every caller that must end a chat's activity — the agent's cleanup, the durable
workflow's final archive, the orphan and stuck-turn sweeps — goes through
:func:`stop_chat`, so the server's interrupt rules are written down once
(chatd-wire §1.7, §1.9, §2):

* ``running`` → ``interrupting`` → (worker winds down) → ``waiting``. The
  interrupt returns at once; the run keeps committing for a moment, so we poll.
* ``requires_action`` → the server closes the pending client calls with
  synthetic error results and the model **continues** (``running``). A second
  interrupt is needed to stop it; a single interrupt leaves a live run behind.
* A queued message can be promoted when an interrupt finishes (``I1`` →
  ``running``): that is a new run, and it is interrupted too.
* 409 ``Chat is not in an interruptible state.``: nothing to interrupt right
  now (already at rest, still ``interrupting``, or archived). We re-read the
  chat and act on what it says; a 409 is never an error here.
* Archive (``PATCH {"archived": true}``) answers 409 while any run is active or
  still winding down; it is retried every ``poll_interval`` within the bound.

"At rest" means ``waiting``, ``error`` or legacy ``completed``: no run, no
pending tool calls. ``requires_action`` is terminal for a *segment* but not at
rest: its pending calls keep the run alive for up to five minutes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coder_chat.errors import CoderApiError, CoderTransportError
from coder_chat.models import AT_REST_STATUSES, Chat
from coder_chat.rest import ChatClient

__all__ = ["AT_REST_STATUSES", "INTERRUPTIBLE_STATUSES", "StopResult", "stop_chat"]

#: Statuses an interrupt acts on (``pending``/``paused`` are legacy, where an
#: interrupt sets ``waiting`` directly).
INTERRUPTIBLE_STATUSES: frozenset[str] = frozenset(
    {"running", "requires_action", "pending", "paused"}
)

BeforeInterrupt = Callable[[Chat], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StopResult:
    """What :func:`stop_chat` did.

    ``status`` is the last status observed (``None`` only if the bound expired
    before the first read). ``settled`` is true when the chat reached a status in
    :data:`AT_REST_STATUSES` within the bound. ``interrupts`` counts interrupts
    the server was seen to accept (HTTP 200; one whose response was lost is not
    counted). ``archived`` is true when the chat is archived at the end (by this
    call or before it); ``was_archived`` when it already was before this call.
    ``last_error`` is the last network failure that was retried, if any.
    """

    chat_id: str
    status: str | None
    settled: bool
    interrupts: int
    archived: bool = False
    was_archived: bool = False
    last_error: str | None = None


async def stop_chat(
    client: ChatClient,
    chat_id: str,
    *,
    timeout: float = 15.0,  # noqa: ASYNC109 - the bound is the primitive's contract
    archive: bool = False,
    before_interrupt: BeforeInterrupt | None = None,
    poll_interval: float = 1.0,
) -> StopResult:
    """Bring ``chat_id`` to rest within ``timeout`` seconds; optionally archive it.

    Reads the chat, then interrupts while it has a run (``running``,
    ``requires_action``): a ``requires_action`` chat is interrupted a second time
    once the server has closed its pending calls and resumed it. While the chat
    is ``interrupting`` (or after a 409) it polls ``GET`` every ``poll_interval``.
    With ``archive=True`` it then archives the settled chat, retrying 409 every
    ``poll_interval`` within the same bound; an unsettled chat is not archived
    (the server would refuse it).

    ``before_interrupt(chat)`` is awaited before **every** interrupt request,
    with the chat as last read, so a durable caller can journal "cut short"
    first; if it raises, no interrupt is sent and the error propagates. It is
    not called for a chat that is already at rest.

    Network failures (:class:`~coder_chat.errors.CoderTransportError`) are
    retried every ``poll_interval`` within the bound, whatever their
    ``retry_safe``: every request sent here may be repeated. The chat is
    re-read first, so an interrupt that landed unseen is not repeated blindly
    (and if its run resumed, stopping that run is the goal anyway). The last
    one is in ``StopResult.last_error``.

    Never raises because the bound expired: the result says ``settled=False``.
    Raises :class:`~coder_chat.errors.CoderApiError` for HTTP errors other than
    the 409s above (a 404 means the chat does not exist or is not visible). The
    caller's own cancellation propagates unchanged.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    state = _Progress()
    try:
        async with asyncio.timeout_at(deadline):
            await _settle(client, chat_id, state, before_interrupt, poll_interval)
            if archive:
                await _archive(client, chat_id, state, before_interrupt, poll_interval)
    except TimeoutError:
        if loop.time() < deadline:
            raise  # not our bound
    return StopResult(
        chat_id=chat_id,
        status=state.status,
        settled=state.settled,
        interrupts=state.interrupts,
        archived=state.archived,
        was_archived=state.was_archived,
        last_error=state.last_error,
    )


@dataclass(slots=True)
class _Progress:
    status: str | None = None
    settled: bool = False
    interrupts: int = 0
    archived: bool = False
    was_archived: bool = False
    last_error: str | None = None
    seen: bool = False


async def _read(client: ChatClient, chat_id: str, state: _Progress, poll: float) -> Chat:
    """GET the chat, retrying network failures every ``poll`` (the bound stops it)."""
    while True:
        try:
            chat = await client.get_chat(chat_id)
        except CoderTransportError as exc:
            state.last_error = str(exc)
            await asyncio.sleep(poll)
            continue
        if not state.seen:
            state.seen = True
            state.was_archived = chat.archived
        state.archived = chat.archived
        state.status = chat.status
        return chat


async def _settle(
    client: ChatClient,
    chat_id: str,
    state: _Progress,
    before_interrupt: BeforeInterrupt | None,
    poll: float,
) -> None:
    chat = await _read(client, chat_id, state, poll)
    while True:
        if chat.status in AT_REST_STATUSES:
            state.settled = True
            return
        if chat.status not in INTERRUPTIBLE_STATUSES or chat.archived:
            # interrupting (winding down) or unknown: wait for the worker.
            await asyncio.sleep(poll)
            chat = await _read(client, chat_id, state, poll)
            continue
        if before_interrupt is not None:
            await before_interrupt(chat)
        paused = chat.status == "requires_action"
        try:
            chat = await client.interrupt_chat(chat_id)
        except CoderApiError as exc:
            if exc.status != 409:
                raise
            # Not interruptible any more (it settled, is winding down, or was
            # archived between our read and the interrupt): look again.
            await asyncio.sleep(poll)
            chat = await _read(client, chat_id, state, poll)
            continue
        except CoderTransportError as exc:
            # It may or may not have landed: look before interrupting again.
            state.last_error = str(exc)
            await asyncio.sleep(poll)
            chat = await _read(client, chat_id, state, poll)
            continue
        state.interrupts += 1
        state.status = chat.status
        if paused and chat.status in INTERRUPTIBLE_STATUSES:
            # The server closed the pending calls and resumed the model
            # (requires_action → running): interrupt that run at once.
            continue
        if chat.status not in AT_REST_STATUSES:
            await asyncio.sleep(poll)
            chat = await _read(client, chat_id, state, poll)


async def _archive(
    client: ChatClient,
    chat_id: str,
    state: _Progress,
    before_interrupt: BeforeInterrupt | None,
    poll: float,
) -> None:
    if state.was_archived:
        return
    while True:
        try:
            await client.archive_chat(chat_id)
        except CoderApiError as exc:
            if exc.status == 400 and "already archived" in exc.message.lower():
                state.archived = True
                return
            if exc.status != 409:
                raise
            # A run is active or still winding down (e.g. a queued message was
            # promoted after we saw the chat at rest): wait, stop it again if it
            # is running, then retry — until the bound.
        except CoderTransportError as exc:
            # Re-sending {"archived": true} is harmless (400 "already archived").
            state.last_error = str(exc)
        else:
            state.archived = True
            return
        state.settled = False
        await asyncio.sleep(poll)
        await _settle(client, chat_id, state, before_interrupt, poll)

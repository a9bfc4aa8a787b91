"""A closed chat stream is freed when its last reference goes, not by the garbage
collector (docs/performance.md, round 11b).

A cancelled task keeps its ``CancelledError``, whose traceback holds the task's
frames, whose ``self`` holds the task: the reader's pump (cancelled by ``aclose``,
waited for with ``asyncio.wait``) was such a cycle, and with it the reader and all
it held stayed alive until a collection — in a fan-out worker ≈ 180 objects per turn
that survived into the older generations. And websockets' connection names itself
in its logger adapter (connection → adapter → connection): its protocol, transport,
socket and keepalive task waited for the collector too. Against the real emulator,
with the collector off: the reader and its connection are gone as soon as they are
dropped (both alive on the old code).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from test_stream_emulator import FAST, client_for, idle_chat, send
from websockets.asyncio.client import ClientConnection

from coder_chat.stream import ChatStreamReader


async def _read_one_turn_and_close(emu: Any) -> weakref.ref[ChatStreamReader]:
    async with client_for(emu) as client:
        chat_id = await idle_chat(client, emu)
        reader = ChatStreamReader(client, chat_id, options=FAST)
        reader.start()
        await send(client, chat_id, "hello")
        while True:  # read until the turn settles: the socket is open and used
            event = await asyncio.wait_for(reader.next_event(), 10)
            assert event is not None
            if (
                event.type == "status"
                and event.status is not None
                and event.status.status == "waiting"
            ):
                break
        await reader.aclose()
        ref = weakref.ref(reader)
        del reader
        return ref


def _connections() -> list[ClientConnection]:
    return [o for o in gc.get_objects() if isinstance(o, ClientConnection)]


async def test_a_closed_reader_is_freed_without_the_collector(
    chatd_emulator_session: Any, collector_off: None
) -> None:
    # Held here, so no new connection can take an old one's id. An earlier test's
    # connection may be freed meanwhile (under xdist one was): only a new one that
    # survives its reader's close fails this.
    earlier = {id(c): c for c in _connections()}
    ref = await _read_one_turn_and_close(chatd_emulator_session)
    await asyncio.sleep(0)  # done callbacks run
    assert ref() is None, gc.get_referrers(ref())
    assert [c for c in _connections() if id(c) not in earlier] == []
    del earlier


async def test_release_drops_only_a_cancelled_tasks_error() -> None:
    from coder_chat.stream import _release_cancellation

    async def fails() -> None:
        raise ValueError("kept")

    async def waits() -> None:
        await asyncio.sleep(10)

    failed = asyncio.get_running_loop().create_task(fails())
    cancelled = asyncio.get_running_loop().create_task(waits())
    failed.add_done_callback(_release_cancellation)
    cancelled.add_done_callback(_release_cancellation)
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.wait({failed, cancelled})
    await asyncio.sleep(0)
    # A failure stays for whoever awaits the task; a cancellation still reads as one.
    assert isinstance(failed.exception(), ValueError)
    assert cancelled.cancelled()
    with pytest.raises(asyncio.CancelledError):
        await cancelled

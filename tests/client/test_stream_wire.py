"""Stream reader against a scripted real WebSocket server: frame-level cases
(replays, coordinate-less deltas, malformed frames, half-dead servers, refusals)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from coder_chat.errors import CoderAgentError, CoderApiError, CoderStreamError
from coder_chat.rest import ChatClient
from coder_chat.stream import ChatStreamReader, StreamOptions

FAST = StreamOptions(backoff_initial_ms=5, backoff_cap_ms=40, open_timeout=2.0, close_timeout=0.5)
TOKEN = "tok-3f9a1c77-secret-value"  # = conftest.TOKEN (the scripted server checks it)
CHAT = "5b0d8c0e-1a52-4c8e-9a0e-3e7d7f6b1a01"


def part(seq: int | None, text: str, hv: int = 7, ga: int = 1) -> dict[str, Any]:
    mp: dict[str, Any] = {"role": "assistant", "part": {"type": "text", "text": text}}
    if seq is not None:
        mp |= {"history_version": hv, "generation_attempt": ga, "seq": seq}
    return {"type": "message_part", "chat_id": CHAT, "message_part": mp}


def msg(mid: int, role: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "chat_id": CHAT,
        "message": {
            "id": mid,
            "chat_id": CHAT,
            "role": role,
            "content": [{"type": "text", "text": text}],
        },
    }


def status(s: str) -> dict[str, Any]:
    return {"type": "status", "chat_id": CHAT, "status": {"status": s}}


async def take(reader: ChatStreamReader, n: int, wait: float = 5.0) -> list[Any]:
    out = []
    for _ in range(n):
        ev = await reader.next_event(timeout=wait)
        assert ev is not None
        out.append(ev)
    return out


def texts(evs: list[Any]) -> list[str]:
    return [e.message_part.part.text for e in evs if e.type == "message_part"]


async def test_replay_after_drop_is_delivered_exactly_once(scripted: Any, events: Any) -> None:
    scripted.add(
        scripted.conn(
            frames=[[msg(11, "user", "hi"), status("running"), part(1, "a"), part(2, "b")]],
            end="abort",
        ),
        scripted.conn(
            frames=[
                [
                    msg(11, "user", "hi"),
                    status("running"),
                    {"type": "preview_reset", "chat_id": CHAT},
                ],
                [part(1, "a"), part(2, "b"), part(3, "c")],
                [msg(12, "assistant", "abc"), status("waiting")],
            ]
        ),
    )
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, after_id=10, options=FAST)
        got = await take(reader, 4 + 3 + 1 + 2)
        await reader.aclose()
        assert await reader.next_event() is None and await reader.next_event() is None
    assert texts(got) == ["a", "b", "c"]
    assert [e.type for e in got] == [
        "message", "status", "message_part", "message_part",
        "message", "status", "preview_reset", "message_part", "message", "status",
    ]  # fmt: skip
    # every dial (and redial) used the turn's original after_id, token only in the header
    assert [d.path for d in scripted.dials] == [f"/api/v2/chats/{CHAT}/stream?after_id=10"] * 2
    assert scripted.preflights == 1  # only while the prefix was unlocked
    assert all(d.headers["Coder-Session-Token"] == TOKEN for d in scripted.dials)
    forwarded = [
        (e.attempt, e.forwarded) for e in events.of("ws:event") if e.event.type == "message_part"
    ]
    assert forwarded == [(1, True), (1, True), (2, False), (2, False), (2, True)]
    closes = events.of("ws:close")
    assert [c.attempt for c in closes] == [1, 2]
    assert closes[0].code == 1006 and closes[1].code is None  # network drop vs our close
    (redial,) = events.of("ws:redial")
    # the drop counts (progress only restarted the count): failure 1 of 5
    assert (redial.attempt, redial.consecutive_failures, redial.backoff_ms) == (1, 1, 5)
    assert events.types()[:4] == ["http:request", "http:response", "ws:dial", "ws:open"]
    assert {e.reader for e in events.of("ws:dial")} == {reader.reader_id}


async def test_revision_cursor_from_status_and_dropped_when_refused(
    scripted: Any, events: Any
) -> None:
    """A redial passes the status event's history_version back under both build names;
    a server that refuses it (400) is redialed by after_id alone, not failed."""
    running = {
        "type": "status",
        "chat_id": CHAT,
        "status": {"status": "running", "history_version": 4},
    }
    scripted.add(
        scripted.conn(
            frames=[[msg(11, "user", "hi"), running, part(1, "a", hv=4, ga=1)]], end="abort"
        ),
        scripted.conn(refuse=400, refuse_body={"message": "Invalid history_version parameter."}),
        scripted.conn(frames=[[running, part(1, "a", hv=4, ga=1), part(2, "b", hv=4, ga=1)]]),
    )
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, after_id=10, options=FAST)
        got = await take(reader, 3 + 2)
        await reader.aclose()
    assert texts(got) == ["a", "b"]
    base = f"/api/v2/chats/{CHAT}/stream?after_id=10"
    assert [d.path for d in scripted.dials] == [
        base,
        base + "&after_revision=4&history_version=4",
        base,
    ]
    assert [r.consecutive_failures for r in events.of("ws:redial")] == [1, 2]


async def test_budget_exhaustion_raises_stream_error(scripted: Any, events: Any) -> None:
    scripted.default_status = 503
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, after_id=3, options=FAST)
        with pytest.raises(CoderStreamError) as info:
            await reader.next_event(timeout=5)
        # sticky: the next read fails the same way
        with pytest.raises(CoderStreamError):
            await reader.next_event(timeout=1)
        await reader.aclose()
    err = info.value
    assert not isinstance(err, CoderAgentError)
    assert err.chat_id == CHAT and err.is_retryable is False
    assert err.url.startswith("ws://") and TOKEN not in err.url and TOKEN not in repr(err)
    assert "5 consecutive connection failures" in str(err)
    assert isinstance(err.cause, CoderApiError) and err.cause.status == 503
    assert len(scripted.dials) == 5
    assert [r.backoff_ms for r in events.of("ws:redial")] == [5, 10, 20, 40]
    assert [r.consecutive_failures for r in events.of("ws:redial")] == [1, 2, 3, 4]
    assert all(r.max_consecutive_failures == 5 for r in events.of("ws:redial"))
    assert len(events.of("ws:close")) == len(events.of("ws:dial")) == 5
    assert len(events.of("ws:error")) == 5


async def test_half_dead_server_replaying_without_progress_exhausts_budget(scripted: Any) -> None:
    replay = [[msg(11, "user", "hi"), status("running"), part(1, "a")]]
    scripted.add(*[scripted.conn(frames=replay, end="close", close_code=1011) for _ in range(6)])
    async with ChatClient(scripted.base_url, TOKEN) as client:
        reader = ChatStreamReader(client, CHAT, after_id=10, options=FAST)
        got = await take(reader, 3)  # first connection is progress: new message + new delta
        assert texts(got) == ["a"]
        with pytest.raises(CoderStreamError):
            while True:
                ev = await reader.next_event(timeout=5)
                assert ev is not None and ev.type in (
                    "message",
                    "status",
                )  # replays: snapshots only
        await reader.aclose()
    # the progressing connection's drop is failure 1, then 4 progress-less replays
    assert len(scripted.dials) == 5


@pytest.mark.parametrize("status_code", [429, 408, 425, 502])
async def test_transient_upgrade_refusals_consume_budget_then_recover(
    scripted: Any, status_code: int
) -> None:
    scripted.add(
        scripted.conn(refuse=status_code),
        scripted.conn(refuse=status_code),
        scripted.conn(frames=[[status("waiting")]]),
    )
    async with ChatClient(scripted.base_url, TOKEN) as client:
        async with ChatStreamReader(client, CHAT, options=FAST) as reader:
            (ev,) = await take(reader, 1)
            assert ev.status is not None and ev.status.status == "waiting"
    assert len(scripted.dials) == 3
    assert scripted.dials[0].path == f"/api/v2/chats/{CHAT}/stream"  # no cursor → no after_id


@pytest.mark.parametrize("status_code", [401, 403, 404])
async def test_non_transient_upgrade_refusal_is_terminal_api_error(
    scripted: Any, events: Any, status_code: int
) -> None:
    scripted.add(
        scripted.conn(refuse=status_code, refuse_body={"message": "nope", "detail": "why"})
    )
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, after_id=1, options=FAST)
        with pytest.raises(CoderApiError) as info:
            await reader.next_event(timeout=5)
        await reader.aclose()
    err = info.value
    assert (err.status, err.method, err.path) == (
        status_code,
        "GET",
        f"/api/v2/chats/{CHAT}/stream",
    )
    assert (err.message, err.detail) == ("nope", "why")
    assert len(scripted.dials) == 1 and events.of("ws:redial") == []
    assert len(events.of("ws:close")) == 1


async def test_malformed_frame_is_terminal_agent_error(scripted: Any, events: Any) -> None:
    scripted.add(scripted.conn(frames=[[status("running")], "{not json"]))
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, options=FAST)
        (first,) = await take(reader, 1)  # events before the bad frame are delivered first
        assert first.type == "status"
        with pytest.raises(CoderAgentError) as info:
            await reader.next_event(timeout=5)
        await reader.aclose()
    assert type(info.value) is CoderAgentError
    assert len(scripted.dials) == 1
    assert any("unparseable" in e.message for e in events.of("ws:error"))
    assert len(events.of("ws:close")) == 1


async def test_unknown_types_and_single_object_frames_tolerated(scripted: Any) -> None:
    scripted.add(
        scripted.conn(
            frames=[
                {"type": "brand_new_event", "chat_id": CHAT, "x": {"y": 1}},
                status("waiting"),
                [{"type": "queue_update", "chat_id": CHAT}],
            ]
        )
    )
    async with ChatClient(scripted.base_url, TOKEN) as client:
        async with ChatStreamReader(client, CHAT, options=FAST) as reader:
            got = await take(reader, 3)
    assert [e.type for e in got] == ["brand_new_event", "status", "queue_update"]
    assert got[2].queued_messages == []


async def test_drop_with_coordinate_less_deltas_is_terminal(scripted: Any) -> None:
    scripted.add(
        scripted.conn(frames=[[status("running"), part(None, "x"), part(None, "y")]], end="abort")
    )
    async with ChatClient(scripted.base_url, TOKEN) as client:
        reader = ChatStreamReader(client, CHAT, options=FAST)
        got = await take(reader, 3)
        assert texts(got) == ["x", "y"]
        with pytest.raises(CoderStreamError, match="cannot be resumed"):
            await reader.next_event(timeout=5)
        await reader.aclose()
    assert len(scripted.dials) == 1


async def test_new_commit_clears_coordinate_less_flag(scripted: Any) -> None:
    scripted.add(
        scripted.conn(
            frames=[[part(None, "x"), msg(20, "assistant", "x")]], end="close", close_code=1001
        ),
        scripted.conn(frames=[[msg(20, "assistant", "x"), status("waiting")]]),
    )
    async with ChatClient(scripted.base_url, TOKEN) as client:
        async with ChatStreamReader(client, CHAT, after_id=19, options=FAST) as reader:
            got = await take(reader, 4)
    assert [e.type for e in got] == ["message_part", "message", "message", "status"]
    assert len(scripted.dials) == 2


async def test_reads_are_memoised_across_timeouts_and_cancellation(scripted: Any) -> None:
    release = asyncio.Event()
    scripted.add(scripted.conn(frames=[[status("running")]], wait_before_end=release, end="close"))
    scripted.add(scripted.conn(frames=[[part(1, "late")]]))
    async with ChatClient(scripted.base_url, TOKEN) as client:
        reader = ChatStreamReader(client, CHAT, options=FAST)
        (ev,) = await take(reader, 1)
        assert ev.type == "status"
        with pytest.raises(TimeoutError):
            await reader.next_event(timeout=0.05)
        with pytest.raises(TimeoutError):
            await reader.next_event(timeout=0)
        # a raced-out (cancelled) read: the event it would have taken is adopted by the next
        pending = asyncio.create_task(reader.next_event())
        await asyncio.sleep(0.02)
        pending.cancel()
        release.set()  # server closes → redial → the next connection delivers the delta
        ev2 = await reader.next_event(timeout=5)
        assert ev2 is not None and texts([ev2]) == ["late"]
        assert reader.next_event_nowait() is None
        await reader.aclose()


async def test_paused_reader_keeps_redialing_and_surfaces_budget_failure_on_resume(
    scripted: Any, events: Any
) -> None:
    scripted.add(scripted.conn(frames=[[status("requires_action")]], end="abort"))
    scripted.default_status = 503
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, after_id=4, options=FAST)
        await take(reader, 1)
        reader.pause()
        assert reader.reusable_for(CHAT) and not reader.reusable_for("other")
        # while "tools run", the pump redials in the background until the budget is spent
        for _ in range(200):
            if len(events.of("ws:close")) >= 5:
                break
            await asyncio.sleep(0.01)
        reader.resume()
        assert reader.reusable_for(CHAT)
        with pytest.raises(CoderStreamError):
            await reader.next_event(timeout=5)
        await reader.aclose()
        assert not reader.reusable_for(CHAT)
    # a status alone is not progress: the first drop counts, then 4 refused dials
    assert len(scripted.dials) == 5


async def test_close_while_waiting_returns_none_and_closes_once(scripted: Any, events: Any) -> None:
    scripted.add(scripted.conn(frames=[]))
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, options=FAST)
        waiter = asyncio.create_task(reader.next_event())
        for _ in range(100):
            if events.of("ws:open"):
                break
            await asyncio.sleep(0.01)
        await reader.aclose()
        assert await asyncio.wait_for(waiter, 2) is None
        await reader.aclose()  # idempotent
    assert len(events.of("ws:close")) == 1 and events.of("ws:close")[0].code is None


async def test_token_never_logged_or_in_events(
    scripted: Any, events: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    scripted.add(
        scripted.conn(refuse=429),
        scripted.conn(frames=[[status("running"), part(1, "a")]], end="abort"),
    )
    scripted.add(scripted.conn(refuse=401))
    async with ChatClient(scripted.base_url, TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, after_id=2, options=FAST)
        await take(reader, 2)
        with pytest.raises(CoderApiError) as info:
            await reader.next_event(timeout=5)
        texts_to_scan = [repr(client), str(client), repr(reader), repr(info.value), str(info.value)]
        await reader.aclose()
    texts_to_scan += [repr(e) for e in events.events]
    client_records = [r for r in caplog.records if not r.name.startswith("tests.")]
    texts_to_scan += [r.getMessage() for r in client_records]
    texts_to_scan += [str(r.args) for r in client_records]
    assert any(r.name.startswith("httpcore") for r in client_records), "DEBUG logs captured"
    for text in texts_to_scan:
        assert TOKEN not in text


async def test_network_failures_consume_the_budget(events: Any) -> None:
    import socket

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with ChatClient(f"http://127.0.0.1:{port}", TOKEN, on_transport_event=events) as client:
        reader = ChatStreamReader(client, CHAT, options=FAST)
        with pytest.raises(CoderStreamError) as info:
            await reader.next_event(timeout=5)
        await reader.aclose()
    assert info.value.cause is not None and TOKEN not in repr(info.value.cause)
    assert len(events.of("ws:dial")) == len(events.of("ws:close")) == 5
    assert len(events.of("http:error")) == 5  # each unlocked dial tried the preflight
    assert all(e.op == "streamEvents" for e in events.of("http:request"))

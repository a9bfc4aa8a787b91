"""Transport event emitter: lazy construction, swallowed handler failures."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from coder_chat.events import HttpRequest, TransportEmitter, WsRedial, next_reader_id, now_ms


def test_no_handler_builds_nothing() -> None:
    built: list[int] = []

    def factory() -> HttpRequest:
        built.append(1)
        return HttpRequest(id=1, op="getChat", method="GET", path="/p")

    TransportEmitter(None).emit(factory)
    assert built == []


def test_event_shape_is_frozen_with_type_and_timestamp() -> None:
    before = now_ms()
    ev = WsRedial(
        chat_id="c",
        reader=1,
        attempt=2,
        consecutive_failures=1,
        max_consecutive_failures=5,
        backoff_ms=1000,
    )
    assert ev.type == "ws:redial" and before <= ev.timestamp <= now_ms()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.attempt = 3  # type: ignore[misc]


def test_sync_handler_exception_is_swallowed() -> None:
    seen: list[str] = []

    def handler(ev: object) -> None:
        seen.append(ev.type)  # type: ignore[attr-defined]
        raise RuntimeError("boom")

    TransportEmitter(handler).emit(lambda: HttpRequest(id=1, op="getChat", method="GET", path="/p"))
    assert seen == ["http:request"]


async def test_async_handler_failure_is_swallowed() -> None:
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    errors: list[object] = []
    loop.set_exception_handler(lambda _l, ctx: errors.append(ctx))
    try:

        async def handler(ev: object) -> None:
            await asyncio.sleep(0)
            seen.append(ev.type)  # type: ignore[attr-defined]
            raise RuntimeError("async boom")

        TransportEmitter(handler).emit(
            lambda: HttpRequest(id=1, op="getChat", method="GET", path="/p")
        )
        for _ in range(5):
            await asyncio.sleep(0)
        assert seen == ["http:request"]
        assert errors == []
    finally:
        loop.set_exception_handler(None)


def test_reader_ids_are_process_wide_increasing() -> None:
    a, b = next_reader_id(), next_reader_id()
    assert b > a

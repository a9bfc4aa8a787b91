"""Raw-wire helpers for the emulator tests (httpx + websockets, no client models)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import websockets

from coder_chat.emulator import Emulator

from .wire_check import check_frame, check_rest

P = "/api/experimental/chats"
V2 = "/api/v2/chats"


async def _check_wire(response: httpx.Response) -> None:
    """Every chat-API JSON body a test sees must match the server's wire types."""
    await response.aread()
    ctype = response.headers.get("content-type", "")
    body = response.json() if ctype.startswith("application/json") and response.content else None
    check_rest(response.request.method, response.request.url.path, response.status_code, body)


def client(emu: Emulator, token: str | None = None) -> httpx.AsyncClient:
    """An httpx client authenticated as ``token`` (default user when None); every
    response body is validated against the wire types (``wire_check``)."""
    return httpx.AsyncClient(
        base_url=emu.base_url,
        headers={"Coder-Session-Token": token or emu.token},
        timeout=10,
        event_hooks={"response": [_check_wire]},
    )


async def create_chat(
    c: httpx.AsyncClient, emu: Emulator, text: str = "hello", prefix: str = P, **extra: Any
) -> dict[str, Any]:
    """POST /chats with one text part; asserts 201."""
    body = {"organization_id": emu.organization_id, "content": [{"type": "text", "text": text}]}
    body.update(extra)
    r = await c.post(prefix, json=body)
    assert r.status_code == 201, r.text
    return r.json()


async def send(
    c: httpx.AsyncClient, chat_id: str, text: str, busy: str | None = None, prefix: str = P
) -> httpx.Response:
    """POST /messages."""
    body: dict[str, Any] = {"content": [{"type": "text", "text": text}]}
    if busy:
        body["busy_behavior"] = busy
    return await c.post(f"{prefix}/{chat_id}/messages", json=body)


async def wait_status(emu: Emulator, chat_id: str, *statuses: str, within: float = 5.0) -> str:
    """Poll introspection until the chat has one of ``statuses``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        st = emu.chat(chat_id)["status"]
        if st in statuses:
            return st
        if loop.time() > deadline:
            raise TimeoutError(f"status {st}, wanted {statuses}")
        await asyncio.sleep(0.003)


class Tap:
    """A raw /stream reader collecting frames and events in the background."""

    def __init__(
        self,
        emu: Emulator,
        chat_id: str,
        after_id: int | None = None,
        token: str | None = None,
        prefix: str = P,
        query: str = "",
    ) -> None:
        q = f"?after_id={after_id}" if after_id is not None else ""
        if query:
            q = (q + "&" if q else "?") + query
        self.url = f"{emu.ws_url}{prefix}/{chat_id}/stream{q}"
        self.headers = {"Coder-Session-Token": token or emu.token}
        self.frames: list[list[dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.ws: Any = None
        self.wire_error: Exception | None = None

    async def __aenter__(self) -> Tap:
        self.ws = await websockets.connect(
            self.url, additional_headers=self.headers, compression=None, ping_interval=None
        )
        self._task = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the socket and stop reading."""
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.wire_error is not None:
            raise AssertionError(f"stream frame does not match the wire types: {self.wire_error}")

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self.raw.append(raw)
                frame = json.loads(raw)
                try:
                    check_frame(frame)  # every frame matches the wire types
                except Exception as exc:
                    self.wire_error = exc
                    raise
                self.frames.append(frame)
                self.events.extend(frame)
                self._changed.set()
        except websockets.ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()
            self._changed.set()

    async def wait_for(
        self, pred: Callable[[list[dict[str, Any]]], bool], within: float = 5.0
    ) -> list[dict[str, Any]]:
        """Wait until ``pred(events)`` holds."""
        async with asyncio.timeout(within):
            while not pred(self.events):
                if self.closed.is_set():
                    raise AssertionError(f"stream closed before condition; events={self.types()}")
                self._changed.clear()
                await self._changed.wait()
        return self.events

    async def wait_status(self, status: str, within: float = 5.0, nth: int = 1) -> None:
        """Wait for the ``nth`` status event with ``status``."""
        await self.wait_for(
            lambda evs: (
                sum(1 for e in evs if e["type"] == "status" and e["status"]["status"] == status)
                >= nth
            ),
            within,
        )

    def types(self) -> list[str]:
        """Event types so far."""
        return [e["type"] for e in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Events of one type."""
        return [e for e in self.events if e["type"] == kind]

    def statuses(self) -> list[str]:
        """Status values in order."""
        return [e["status"]["status"] for e in self.of("status")]

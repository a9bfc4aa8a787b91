"""Lost ``action_required`` recovery (agent-semantics §3.5) against the real emulator.

The emulator re-sends ``action_required`` on every reconnect, so no stream fault
can lose it. A lossy middlebox can: :class:`LossyProxy` is a real TCP proxy in
front of the emulator that forwards every byte, except that it removes the
first ``action_required`` event from the server→client WebSocket frames (server
frames are unmasked, so it re-encodes the frame without that event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
from typing import Any

import pytest
from sample_tools import add

from coder_chat import AgentTimings, CoderAgent, StreamOptions
from coder_chat.emulator.script import Script
from coder_chat.emulator.server import Emulator


class LossyProxy:
    """TCP proxy that drops the first ``drop`` action_required events it relays."""

    def __init__(self, upstream_port: int, drop: int = 1) -> None:
        self.upstream_port = upstream_port
        self.drop = drop
        self.dropped = 0
        self.base_url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> LossyProxy:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        up = asyncio.create_task(self._pipe(cr, uw))
        down = asyncio.create_task(self._down(ur, cw))
        self._tasks.update({up, down})
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (cw, uw):
            w.close()

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()

    async def _down(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        buf = b""
        while True:  # HTTP responses pass through until a 101 switches to frames
            data = await r.read(65536)
            if not data:
                return
            buf += data
            if b"\r\n\r\n" in buf and buf.startswith(b"HTTP/1.1 101"):
                head, buf = buf.split(b"\r\n\r\n", 1)
                w.write(head + b"\r\n\r\n")
                break
            w.write(buf)
            buf = b""
            await w.drain()
        reader = _Prefixed(buf, r)
        while True:
            b0, b1 = await reader.read(2)
            length = b1 & 0x7F
            ext = b""
            if length == 126:
                ext = await reader.read(2)
                length = struct.unpack("!H", ext)[0]
            elif length == 127:
                ext = await reader.read(8)
                length = struct.unpack("!Q", ext)[0]
            payload = await reader.read(length)
            if b0 & 0x0F == 1 and b0 & 0x80 and self.dropped < self.drop:
                payload = self._filter(payload)
                w.write(_frame(b0, payload))
            else:
                w.write(bytes([b0, b1]) + ext + payload)
            await w.drain()

    def _filter(self, payload: bytes) -> bytes:
        events = json.loads(payload)
        kept = []
        for ev in events if isinstance(events, list) else [events]:
            if ev.get("type") == "action_required" and self.dropped < self.drop:
                self.dropped += 1
                continue
            kept.append(ev)
        return json.dumps(kept).encode()


class _Prefixed:
    def __init__(self, prefix: bytes, r: asyncio.StreamReader) -> None:
        self.buf, self.r = prefix, r

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.r.read(65536)
            if not chunk:
                raise ConnectionError("upstream closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def _frame(b0: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        return bytes([b0, n]) + payload
    if n < 65536:
        return bytes([b0, 126]) + struct.pack("!H", n) + payload
    return bytes([b0, 127]) + struct.pack("!Q", n) + payload


# The emulator runs on its own loop in another thread (the chatd_emulator fixture),
# like a real server: the client loop never shares work with it.
pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)


@pytest.fixture
def emu(chatd_emulator: Emulator) -> Emulator:
    return chatd_emulator


def directive(script: Script) -> str:
    return f"go #emu {json.dumps(script.to_json())}"


async def test_lost_action_required_recovered_from_history(
    chatd_era: str, emu: Emulator, events: Any
) -> None:
    async with LossyProxy(emu.port) as proxy:
        agent = CoderAgent(
            base_url=proxy.base_url,
            token=emu.token,
            organization_id=emu.organization_id,
            tools=[add],
            on_transport_event=events,
            stream_options=StreamOptions(backoff_initial_ms=10),
            timings=AgentTimings(action_grace=0.3),
            request_timeout=10,
        )
        started = time.monotonic()
        r = await agent.generate(directive(Script.client_tool("add", {"a": 40, "b": 2})))
        elapsed = time.monotonic() - started
        assert proxy.dropped == 1
        assert r.text == "Results: add → 42"
        assert [(c.input, c.output) for c in r.client_tool_calls] == [({"a": 40, "b": 2}, 42)]
        assert elapsed >= 0.3  # waited out the grace first
        fetches = [e for e in events.of("http:request") if e.op == "getMessages"]
        assert len(fetches) == 1  # one recovery per wait
        assert len(events.of("ws:dial")) == 1  # recovered without a reconnect
        await agent.aclose()


async def test_no_recovery_when_the_event_arrives(emu: Emulator, events: Any) -> None:
    agent = CoderAgent(
        base_url=emu.base_url,
        token=emu.token,
        organization_id=emu.organization_id,
        tools=[add],
        on_transport_event=events,
        timings=AgentTimings(action_grace=0.3),
    )
    r = await agent.generate(directive(Script.client_tool("add", {"a": 1, "b": 2})))
    assert r.text == "Results: add → 3"
    assert not [e for e in events.of("http:request") if e.op == "getMessages"]
    await agent.aclose()

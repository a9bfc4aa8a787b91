"""Fixtures for the client transport tests.

Most tests talk to the chatd emulator (``chatd_emulator`` fixture of
``coder_chat.emulator.pytest_plugin``). A few wire-level cases the emulator
cannot produce on purpose — coordinate-less deltas, a malformed frame, a
404 on one prefix only, a server that accepts and replays then drops — use
the small real servers below (real sockets, real websockets/HTTP, no mocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.tls import self_signed_server_context
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from coder_chat.emulator import ERA_NAMES
from coder_chat.emulator.eras import ERA_ENV
from coder_chat.events import TransportEvent

TOKEN = "tok-3f9a1c77-secret-value"

# The era matrix. Tests whose behaviour differs per server build (prefix, stream cursor,
# dedup, queue stamps, interrupts, listing) ask for ``chatd_era`` and run once per era.
# A run pinned to one era with CODER_CHAT_EMULATOR_ERA runs them at that era only:
# scripts/test pins its main run to the newest build and adds a pass per older build
# for tests/client and tests/recovery, so nothing runs twice.
MATRIX_ERAS = (os.environ[ERA_ENV].lower(),) if os.environ.get(ERA_ENV) else ERA_NAMES


@pytest.fixture(params=MATRIX_ERAS)
def chatd_era(request: pytest.FixtureRequest) -> str:
    """The server build under test (see MATRIX_ERAS)."""
    return str(request.param)


SERVER_LOGGER = "tests.scripted_chatd"


@dataclass
class Conn:
    """Script for one incoming stream connection."""

    refuse: int | None = None  # answer the upgrade with this HTTP status
    refuse_body: dict[str, Any] | None = None
    frames: list[Any] = field(default_factory=list)  # JSON-able (dumped) or raw str
    frame_delay: float = 0.0
    end: str = "hold"  # "hold" | "close" | "abort"
    close_code: int = 1000
    wait_before_end: asyncio.Event | None = None


@dataclass
class Dial:
    path: str
    headers: Headers


class ScriptedChatd:
    """A real websockets server replaying per-connection scripts.

    ``GET /api/v2/chats`` (the prefix preflight) answers ``[]``; a dial beyond
    the scripts is refused with ``default_status``.
    """

    token = TOKEN
    conn = Conn  # tests build scripts with ``scripted.conn(...)`` (no conftest imports)

    def __init__(self, ssl: Any = None) -> None:
        self._ssl = ssl
        self.scripts: list[Conn] = []
        self.dials: list[Dial] = []
        self.preflights = 0
        self.default_status = 503
        self._server: Any = None
        self.base_url = ""
        self._handlers: set[asyncio.Task[None]] = set()

    def add(self, *conns: Conn) -> None:
        self.scripts.extend(conns)

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        if "/stream" not in request.path:
            self.preflights += 1
            return _http(200, [])
        self.dials.append(Dial(request.path, request.headers))
        script = self.scripts.pop(0) if self.scripts else Conn(refuse=self.default_status)
        conn.script = script  # type: ignore[attr-defined]
        if request.headers.get("Coder-Session-Token") != TOKEN:
            return _http(401, {"message": "You must be logged in."})
        if script.refuse is not None:
            return _http(
                script.refuse, script.refuse_body or {"message": f"refused {script.refuse}"}
            )
        return None

    async def _handler(self, conn: ServerConnection) -> None:
        script: Conn = conn.script  # type: ignore[attr-defined]
        for frame in script.frames:
            if script.frame_delay:
                await asyncio.sleep(script.frame_delay)
            await conn.send(frame if isinstance(frame, str) else json.dumps(frame))
        if script.wait_before_end is not None:
            await script.wait_before_end.wait()
        if script.end == "close":
            await conn.close(script.close_code)
        elif script.end == "abort":
            await asyncio.sleep(0.01)  # let the frames reach the socket first
            assert conn.transport is not None
            conn.transport.abort()
        else:
            await conn.wait_closed()

    async def __aenter__(self) -> ScriptedChatd:
        self._server = await serve(
            self._handler,
            "127.0.0.1",
            0,
            process_request=self._process_request,
            compression=None,
            # The server side logs the headers it received at DEBUG; keep those apart
            # from the client's records that token scans inspect.
            logger=logging.getLogger(SERVER_LOGGER),
            ssl=self._ssl,
        )
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"{'https' if self._ssl else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


def _http(status: int, body: Any) -> Response:
    data = json.dumps(body).encode()
    headers = Headers(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Connection", "close"),
        ]
    )
    return Response(status, "Status", headers, data)


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedChatd]:
    async with ScriptedChatd() as server:
        yield server


# --------------------------------------------------------------------- tiny HTTP server

Route = Callable[[str, str, bytes], Awaitable[tuple[int, Any]] | tuple[int, Any]]


class MiniHttp:
    """A minimal real HTTP/1.1 server (asyncio streams).

    ``route(method, path_with_query, body) -> (status, json_body)``; status 0 closes
    the connection without a response. One response per connection, unless
    ``keep_alive`` (then it serves requests on a connection until the client closes
    it). ``extra_headers`` go into every response (e.g. a ``Set-Cookie``).
    ``requests`` has each request's method, target and lower-cased headers;
    ``heads`` its request line and header lines exactly as they arrived (order,
    case, repeats); ``connections`` counts accepted connections.
    """

    def __init__(
        self,
        route: Route,
        ssl: Any = None,
        *,
        keep_alive: bool = False,
        extra_headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.route = route
        self._ssl = ssl
        self._keep_alive = keep_alive
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in extra_headers)
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.heads: list[tuple[str, list[tuple[str, str]]]] = []
        self.connections = 0
        self.base_url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await self._answer_one(reader, writer) and self._keep_alive:
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        raw = [
            (k.strip(), v.strip()) for k, sep, v in (ln.partition(":") for ln in lines[1:]) if sep
        ]
        headers = {k.lower(): v for k, v in raw}
        body = b""
        if int(headers.get("content-length", "0")):
            body = await reader.readexactly(int(headers["content-length"]))
        self.requests.append((method, target, headers))
        self.heads.append((lines[0], raw))
        result = self.route(method, target, body)
        if not isinstance(result, tuple):
            result = await result
        status, payload = result
        if status == 0:  # "drop": close without answering (a network failure)
            return False
        data = b"" if payload is None else json.dumps(payload).encode()
        close = "" if self._keep_alive else "Connection: close\r\n"
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{self._extra}"
            f"Content-Length: {len(data)}\r\n{close}\r\n".encode()
            + data
        )
        await writer.drain()
        return True

    async def __aenter__(self) -> MiniHttp:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._ssl)
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"{'https' if self._ssl else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


class EventLog:
    """Transport-event recorder."""

    def __init__(self) -> None:
        self.events: list[TransportEvent] = []

    def __call__(self, event: TransportEvent) -> None:
        self.events.append(event)

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.type == kind]

    def types(self) -> list[str]:
        return [e.type for e in self.events]


@pytest.fixture
def mini_http() -> type[MiniHttp]:
    """The MiniHttp class (``async with mini_http(route) as server``)."""
    return MiniHttp


@pytest.fixture
def events() -> EventLog:
    return EventLog()


@pytest.fixture(scope="session")
def self_signed_tls(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server-side SSLContext with a fresh self-signed certificate for 127.0.0.1."""
    return self_signed_server_context(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def scripted_server() -> type[ScriptedChatd]:
    """The ScriptedChatd class, for tests that need their own (e.g. TLS) instance."""
    return ScriptedChatd

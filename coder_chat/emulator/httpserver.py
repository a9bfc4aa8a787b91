"""A small HTTP/1.1 + WebSocket server on asyncio streams.

Why not an ASGI server: the fault API needs things ASGI hides — closing a connection
after the handler committed but before any response byte ("landed, response lost"),
aborting every socket on a restart while keeping the process, and stalling a WebSocket
without pings. WebSocket framing uses the websockets library's sans-I/O ``ServerProtocol``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from websockets.exceptions import InvalidState
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from .faults import status_message

# websockets' protocol logs every handshake header at DEBUG, the session token
# included. The emulator must keep secrets out of logs like the real server, so its
# protocol logger never goes below WARNING whatever the root level is (its INFO
# lines are per-connection noise).
_WS_LOGGER = logging.getLogger("coder_chat.emulator.websocket")
_WS_LOGGER.setLevel(logging.WARNING)
_LOG = logging.getLogger("coder_chat.emulator.http")

# A peer that goes away mid-request or mid-stream is normal (clients drop, faults drop
# them): these end the connection quietly. Anything else is an emulator bug and is logged.
_PEER_GONE = (ConnectionError, OSError, asyncio.IncompleteReadError, InvalidState)

MAX_HEAD = 64 * 1024
MAX_BODY = 11 * 1024 * 1024

REASONS = {
    200: "OK",
    201: "Created",
    202: "Accepted",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Request Entity Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass
class Request:
    """A parsed HTTP request."""

    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""
    raw_head: bytes = b""
    too_large: bool = False

    def header(self, name: str) -> str | None:
        """Header value by case-insensitive name."""
        return self.headers.get(name.lower())

    def param(self, name: str) -> str | None:
        """A query parameter's last value (None when absent), as Go's ``Query().Get``
        would see a repeated one only once."""
        vals = self.query.get(name)
        return vals[-1] if vals else None

    def json(self) -> Any:
        """Body parsed as JSON (raises ValueError)."""
        return json.loads(self.body or b"null")

    @property
    def is_upgrade(self) -> bool:
        """True for a WebSocket upgrade request."""
        return (self.header("upgrade") or "").lower() == "websocket"


@dataclass
class Response:
    """An HTTP response."""

    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(status: int, obj: Any) -> Response:
    """Serialise ``obj`` as JSON (Go's json.Encoder adds a trailing newline)."""
    return Response(status, json.dumps(obj).encode() + b"\n")


def error_response(
    status: int, message: str, detail: str | None = None, validations: list[Any] | None = None
) -> Response:
    """The Coder error envelope."""
    body: dict[str, Any] = {"message": message}
    if detail:
        body["detail"] = detail
    if validations:
        body["validations"] = validations
    return json_response(status, body)


class DropResponse:
    """Handler result: close the connection without writing a response."""


DROP = DropResponse()


class WebSocket:
    """A server-side WebSocket over a websockets sans-I/O protocol."""

    def __init__(
        self,
        proto: ServerProtocol,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.proto = proto
        self.reader = reader
        self.writer = writer
        self.closed = asyncio.Event()
        self._pong = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start reading client frames (pongs, close)."""
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def is_open(self) -> bool:
        """True while frames may be sent (no close started by either side)."""
        return not self.closed.is_set() and self.proto.state is State.OPEN

    def _flush(self) -> None:
        gone = self.writer.transport is None or self.writer.transport.is_closing()
        for data in self.proto.data_to_send():
            if gone:
                continue  # the peer is gone: writing would only log socket.send() warnings
            if data:
                self.writer.write(data)
            else:
                # An empty chunk means "half-close"; we just close the transport.
                self.writer.close()

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    self.proto.receive_eof()
                    self._flush()
                    break
                self.proto.receive_data(data)
                for ev in self.proto.events_received():
                    if getattr(ev, "opcode", None) is Opcode.PONG:
                        self._pong.set()
                self._flush()
                if self.proto.close_code is not None or self.proto.state.name == "CLOSED":
                    break
        except _PEER_GONE as exc:
            _LOG.debug("websocket read ended: %r", exc)
        finally:
            self.closed.set()
            with contextlib.suppress(Exception):
                self.writer.close()

    async def send_text(self, data: bytes) -> None:
        """Send one text frame (bytes are UTF-8 JSON)."""
        # A close started by either side (client close frame, a drop fault's close code)
        # makes the protocol refuse data frames; to the session that is a closed socket.
        if not self.is_open:
            raise ConnectionError("websocket closed")
        try:
            self.proto.send_text(data)
        except InvalidState as exc:
            raise ConnectionError("websocket closed") from exc
        self._flush()
        await self.writer.drain()

    async def ping(self, wait: float) -> bool:
        """Send a ping; True when a pong arrived within ``wait`` seconds."""
        if not self.is_open:
            return False
        self._pong.clear()
        try:
            self.proto.send_ping(os.urandom(4))
        except InvalidState:
            return False
        self._flush()
        try:
            await asyncio.wait_for(self._pong.wait(), wait)
        except TimeoutError:
            return False
        return True

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close handshake (best effort), then the transport."""
        if not self.closed.is_set():
            with contextlib.suppress(Exception):
                self.proto.send_close(code, reason)
                self._flush()
                await asyncio.wait_for(self.writer.drain(), 1.0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.closed.wait(), 1.0)
        self.abort()

    def abort(self) -> None:
        """Drop the TCP connection without a close frame."""
        transport = self.writer.transport
        if transport is not None and not transport.is_closing():
            transport.abort()
        self.closed.set()
        if self._reader_task is not None:
            self._reader_task.cancel()


@dataclass
class Upgrade:
    """Handler result for an accepted upgrade: ``run`` drives the open socket."""

    run: Callable[[WebSocket], Awaitable[None]]


Handler = Callable[[Request], Awaitable["Response | DropResponse | Upgrade"]]


class HttpServer:
    """Listens, parses requests, dispatches to ``handler``; restartable on the same port."""

    def __init__(
        self, handler: Handler, host: str, port: int, *, tls: ssl.SSLContext | None = None
    ) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        #: Server-side TLS context (``https``/``wss``), or None for plain HTTP.
        self.tls = tls
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Bind and listen (port 0 picks a free port, remembered for restarts)."""
        self._server = await asyncio.start_server(
            self._on_conn,
            self.host,
            self.port,
            reuse_address=True,
            limit=MAX_HEAD,
            backlog=2048,
            ssl=self.tls,
        )
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]

    async def stop(self, *, abort_connections: bool = True) -> None:
        """Close the listener and (by default) every connection."""
        if self._server is not None:
            self._server.close()
        if abort_connections:
            for w in list(self._conns):
                t = w.transport
                if t is not None and not t.is_closing():
                    t.abort()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._server = None

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._conns.add(writer)
        try:
            await self._serve(reader, writer)
        except (*_PEER_GONE, asyncio.LimitOverrunError) as exc:
            _LOG.debug("connection ended: %r", exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            # A bug in a handler: log it once here, and still close the connection.
            _LOG.exception("unhandled error serving a connection")
        finally:
            self._conns.discard(writer)
            self._tasks.discard(task)
            t = writer.transport
            if t is not None and not t.is_closing():
                t.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            req = _parse_head(head)
            if req is None:
                writer.write(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                await writer.drain()
                return
            keep_alive = (req.header("connection") or "").lower() != "close"
            if req.is_upgrade:
                await self._upgrade(req, reader, writer)
                return
            te = (req.header("transfer-encoding") or "").lower()
            if "chunked" in te:
                body = await _read_chunked(reader)
                if body is None:
                    req.too_large = True
                    keep_alive = False
                else:
                    req.body = body
            else:
                n = int(req.header("content-length") or 0)
                if n > MAX_BODY:
                    req.too_large = True
                    keep_alive = False
                elif n:
                    req.body = await reader.readexactly(n)
            result = await self.handler(req)
            if isinstance(result, DropResponse):
                t = writer.transport
                if t is not None:
                    t.abort()
                return
            if isinstance(result, Upgrade):  # pragma: no cover - only for upgrade requests
                result = error_response(400, "Expected a WebSocket upgrade.")
            writer.write(_serialize(result, keep_alive))
            await writer.drain()
            if not keep_alive:
                return

    async def _upgrade(
        self, req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        result = await self.handler(req)
        if isinstance(result, DropResponse):
            t = writer.transport
            if t is not None:
                t.abort()
            return
        if isinstance(result, Response):
            writer.write(_serialize(result, False))
            await writer.drain()
            return
        proto = ServerProtocol(max_size=1 << 20, logger=_WS_LOGGER)
        proto.receive_data(req.raw_head)
        events = proto.events_received()
        if not events:
            writer.write(_serialize(error_response(400, "Bad WebSocket handshake."), False))
            await writer.drain()
            return
        response = proto.accept(events[0])  # type: ignore[arg-type]
        proto.send_response(response)
        for data in proto.data_to_send():
            writer.write(data)
        await writer.drain()
        if response.status_code != 101:
            return
        ws = WebSocket(proto, reader, writer)
        ws.start()
        try:
            await result.run(ws)
        finally:
            ws.abort()


def _parse_head(head: bytes) -> Request | None:
    try:
        text = head.decode("latin-1")
        lines = text.split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            k, _, v = line.partition(":")
            key = k.strip().lower()
            val = v.strip()
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
    except ValueError:
        return None
    parts = urlsplit(target)
    return Request(
        method=method.upper(),
        target=target,
        path=unquote(parts.path),
        query=parse_qs(parts.query, keep_blank_values=True),
        headers=headers,
        raw_head=head,
    )


async def _read_chunked(reader: asyncio.StreamReader) -> bytes | None:
    body = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)
        if len(body) > MAX_BODY:
            return None


def _serialize(resp: Response, keep_alive: bool) -> bytes:
    reason = REASONS.get(resp.status) or status_message(resp.status)
    lines = [f"HTTP/1.1 {resp.status} {reason}"]
    if resp.content_type and resp.status != 204:
        lines.append(f"Content-Type: {resp.content_type}")
    body = b"" if resp.status == 204 else resp.body
    if resp.status != 204:
        lines.append(f"Content-Length: {len(body)}")
    for k, v in resp.headers.items():
        lines.append(f"{k}: {v}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

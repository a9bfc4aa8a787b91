"""Transport events (agent-semantics spec §6) and a safe emitter.

Every event is a frozen, keyword-only dataclass with a ``type`` string (e.g.
``"http:request"``) and ``timestamp`` (epoch milliseconds at observation).
Events never carry headers or the session token: HTTP events carry the path
only (never the query string of a file upload or the full URL), WS events the
stream URL (which never holds the token).

Use :class:`TransportEmitter` to publish::

    emitter = TransportEmitter(handler)           # handler may be None
    emitter.emit(lambda: HttpRequest(id=1, op="getChat", method="GET", path=p))

The factory is only called when a handler is set, so no event object is built
otherwise. Handler exceptions are swallowed — both a sync ``raise`` and an
async handler's failed coroutine (the coroutine is scheduled as a task on the
running loop; its exception is retrieved and dropped). Observability must
never break a turn.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "HttpError",
    "HttpRequest",
    "HttpResponse",
    "SegmentSettle",
    "SegmentStart",
    "TransportEmitter",
    "TransportEvent",
    "TransportEventHandler",
    "WsClose",
    "WsDial",
    "WsError",
    "WsEvent",
    "WsOpen",
    "WsRedial",
    "next_reader_id",
    "now_ms",
]

_log = logging.getLogger(__name__)


def now_ms() -> int:
    """Wall-clock epoch milliseconds (the ``timestamp`` of every event)."""
    return time.time_ns() // 1_000_000


_reader_ids = itertools.count(1)


def next_reader_id() -> int:
    """Process-wide stream reader id (identify a connection by chat_id, reader, attempt)."""
    return next(_reader_ids)


def _ts() -> int:
    return now_ms()


# ----------------------------------------------------------------------- http


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpRequest:
    """A REST request is about to be sent. ``id`` correlates with its response/error."""

    type: Literal["http:request"] = field(default="http:request", init=False)
    timestamp: int = field(default_factory=_ts)
    id: int
    op: str
    method: str
    path: str


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpResponse:
    """Response headers received (2xx or not)."""

    type: Literal["http:response"] = field(default="http:response", init=False)
    timestamp: int = field(default_factory=_ts)
    id: int
    op: str
    method: str
    path: str
    status: int
    ok: bool
    duration_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpError:
    """The request failed without a response (network error, timeout, cancellation)."""

    type: Literal["http:error"] = field(default="http:error", init=False)
    timestamp: int = field(default_factory=_ts)
    id: int
    op: str
    method: str
    path: str
    message: str
    duration_ms: float


# ----------------------------------------------------------------------- ws


@dataclass(frozen=True, kw_only=True, slots=True)
class WsDial:
    """A stream connection attempt starts (``attempt`` is 1-based per reader)."""

    type: Literal["ws:dial"] = field(default="ws:dial", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    reader: int
    attempt: int
    url: str


@dataclass(frozen=True, kw_only=True, slots=True)
class WsOpen:
    """The WebSocket handshake completed."""

    type: Literal["ws:open"] = field(default="ws:open", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    reader: int
    attempt: int


@dataclass(frozen=True, kw_only=True, slots=True)
class WsEvent:
    """One decoded stream event at arrival. ``forwarded`` is False only for a
    suppressed replayed delta (snapshots are always forwarded)."""

    type: Literal["ws:event"] = field(default="ws:event", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    reader: int
    attempt: int
    event: Any
    forwarded: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class WsClose:
    """Emitted exactly once per dial. ``code``/``reason`` only when the server or the
    network closed it (None when we closed it or the upgrade never completed)."""

    type: Literal["ws:close"] = field(default="ws:close", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    reader: int
    attempt: int
    code: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class WsError:
    """Socket error, rejected upgrade or unparseable frame."""

    type: Literal["ws:error"] = field(default="ws:error", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    reader: int
    attempt: int
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class WsRedial:
    """Before the backoff wait; ``attempt`` is the connection that ended."""

    type: Literal["ws:redial"] = field(default="ws:redial", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    reader: int
    attempt: int
    consecutive_failures: int
    max_consecutive_failures: int
    backoff_ms: int


# ----------------------------------------------------------------------- segment


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentStart:
    """A segment (one model round-trip) begins; ``segment`` is 1-based per agent."""

    type: Literal["segment:start"] = field(default="segment:start", init=False)
    timestamp: int = field(default_factory=_ts)
    segment: int
    chat_id: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentSettle:
    """Exactly once per :class:`SegmentStart`.

    ``ending``: ``"clean"`` (``status`` + ``finish_reason``; a promotion-boundary
    settle has ``finish_reason="stop"`` and no status), ``"failure"`` (``error`` =
    ``{"name", "message"}``, plus ``status`` when the server still settled
    terminally) or ``"teardown"`` (neither).
    """

    type: Literal["segment:settle"] = field(default="segment:settle", init=False)
    timestamp: int = field(default_factory=_ts)
    segment: int
    chat_id: str | None = None
    reader: int | None = None
    duration_ms: float
    ending: Literal["clean", "failure", "teardown"]
    status: str | None = None
    finish_reason: str | None = None
    error: dict[str, str] | None = None


# ----------------------------------------------------------------------- tools


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolRun:
    """A client tool call ran in this process (once per call the agent executes).

    ``outcome``: ``"ok"``, ``"error"`` (the model is told the tool failed) or
    ``"failed-turn"`` (the call's bookkeeping failed: the turn fails and the pause
    stays for recovery). Never carries the call's arguments or output: they may hold
    secrets, and a log line must not.
    """

    type: Literal["tool:run"] = field(default="tool:run", init=False)
    timestamp: int = field(default_factory=_ts)
    chat_id: str
    tool_call_id: str
    tool_name: str
    duration_ms: float
    outcome: Literal["ok", "error", "failed-turn"]
    #: For ``"error"``: what was raised and its error id (:attr:`ToolOutcome.error`).
    error: str | None = None


TransportEvent = (
    HttpRequest
    | HttpResponse
    | HttpError
    | WsDial
    | WsOpen
    | WsEvent
    | WsClose
    | WsError
    | WsRedial
    | SegmentStart
    | SegmentSettle
    | ToolRun
)

TransportEventHandler = Callable[[TransportEvent], object]


class TransportEmitter:
    """Calls an optional handler with lazily built events, swallowing its failures."""

    __slots__ = ("_handler", "_tasks")

    def __init__(self, handler: TransportEventHandler | None = None) -> None:
        self._handler = handler
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def handler(self) -> TransportEventHandler | None:
        return self._handler

    @property
    def enabled(self) -> bool:
        return self._handler is not None

    def __repr__(self) -> str:
        return f"TransportEmitter(enabled={self.enabled})"

    def emit(self, factory: Callable[[], TransportEvent]) -> None:
        """Build the event with ``factory`` and hand it to the handler, if any."""
        handler = self._handler
        if handler is None:
            return
        try:
            result = handler(factory())
        except Exception:
            _log.debug("transport event handler raised; ignored", exc_info=True)
            return
        if inspect.isawaitable(result):
            self._schedule(result)

    def _schedule(self, awaitable: Any) -> None:
        async def run() -> None:
            try:
                await awaitable
            except Exception:
                _log.debug("async transport event handler failed; ignored", exc_info=True)

        try:
            task = asyncio.get_running_loop().create_task(run())
        except RuntimeError:
            # No running loop: close a coroutine so it does not warn "never awaited".
            close = getattr(awaitable, "close", None)
            if callable(close):
                close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

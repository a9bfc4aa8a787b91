# `next_event(timeout=)` is the memoised-read contract the agent relies on.
# ruff: noqa: ASYNC109
"""Chat stream reader: one retained WebSocket subscription to ``/{chat}/stream``
with redial, replay dedup and memoised reads (agent-semantics §4, §6).

Usage by the agent (one reader per turn, shared by the turn's segments)::

    reader = ChatStreamReader(client, chat_id, after_id=turn_after_id,
                              options=StreamOptions())
    try:
        while True:
            event = await reader.next_event(timeout=remaining_segment_budget)
            if event is None:          # closed by us (aclose/close_nowait)
                break
            ...                        # feed the translator
    except TimeoutError: ...           # nothing lost: the pending read is kept
    # healthy requires_action pause: keep it, run tools, then resume
    reader.pause(); await run_tools(); reader.resume()
    # any other segment exit
    await reader.aclose()

Design:

* **Own lifetime.** :meth:`start` (or the first :meth:`next_event`) spawns a
  background *pump* task, detached from the caller's task, which dials,
  reads, dedups and redials, feeding an ``asyncio.Queue``. A caller's
  cancellation or timeout of ``next_event`` never touches the socket, and an
  event taken off the socket is never lost: it waits in the queue for the
  next read (reads are thereby memoised: a read abandoned by a raced-out
  segment is adopted by the next caller). Only :meth:`aclose` /
  :meth:`close_nowait` end the pump.
* **Pause.** While client tools run, the stream is *paused*
  (:meth:`pause`/:meth:`resume` are bookkeeping: the pump keeps reading and
  redialing in the background, from the original ``after_id``). If the redial
  budget runs out meanwhile, the failure is stored and the next read raises it
  (the resume segment fails with it). :meth:`reusable_for` says whether a
  resume segment may attach (not closed, same chat).
* **Terminal outcomes** are sticky: once the pump ends, every later
  ``next_event`` first drains the queued events, then raises the same error
  again (or returns ``None`` after a close). Errors:

  - :class:`~coder_chat.errors.CoderStreamError` — 5 consecutive connection
    endings (the drop that starts an outage counts; forward progress restarts
    the count, ≈ 15 s of backoff), or a drop while coordinate-less deltas were
    outstanding (a replay could not be deduped);
  - :class:`~coder_chat.errors.CoderApiError` ``(status, "GET", path)`` — the
    upgrade was refused with a 4xx other than 408/425/429;
  - :class:`~coder_chat.errors.CoderAgentError` — an unparseable frame (a
    redial would replay it forever); the agent wraps it as
    ``CoderChatError(kind="stream_closed", retryable=True)``.

* **Dial.** ``ws(s)://host{prefix}/{chat}/stream[?after_id=N]`` with the
  ``Coder-Session-Token`` header; every redial reuses the ORIGINAL ``after_id``
  so same-id revisions committed during a gap are not lost (the translator's
  ledger and id cursor drop what it already has). When the server reported a
  revision cursor (the ``history_version`` of a ``status`` event: B2 and later),
  a redial also passes it (``after_revision`` for B2, ``history_version`` for
  B3), so the server re-sends only messages revised since; it still re-sends any
  revision committed during the gap. B1 reports none and is redialed by
  ``after_id`` alone, and so is a reader whose cursor a server refused (HTTP 400
  on a dial that carried it: that dial consumes the budget, the next one goes
  without the cursor). With no locked REST prefix
  each dial is preceded by the ``GET /api/v2/chats`` preflight (op
  ``streamEvents``). The websockets library logger is kept below DEBUG: its
  debug output would print the handshake headers.
* **Redial.** Backoff ``backoff_initial_ms`` doubling to ``backoff_cap_ms``
  (no jitter), reset on forward progress; ``ws:redial`` is emitted before each
  wait. Upgrade 408/425/429, 5xx and network errors consume the budget.
* **Events.** ``ws:dial``/``ws:open``/``ws:event`` (with ``forwarded``)/
  ``ws:close`` (exactly once per dial; ``code``/``reason`` only when the
  server or network closed it)/``ws:error``/``ws:redial``; ``reader`` is a
  process-wide id, ``attempt`` 1-based per reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Generic, Self, TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from coder_chat.core.backoff import BackoffPolicy, RedialBudget
from coder_chat.core.dedup import ReplayFilter
from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderStreamError,
    CoderTransportError,
)
from coder_chat.events import (
    TransportEmitter,
    WsClose,
    WsDial,
    WsError,
    WsEvent,
    WsOpen,
    WsRedial,
    next_reader_id,
)
from coder_chat.models import ChatStreamEvent, ChatWatchEvent, parse_frame
from coder_chat.rest import ChatClient

__all__ = ["TRANSIENT_UPGRADE_STATUSES", "ChatStreamReader", "ChatWatcher", "StreamOptions"]

T = TypeVar("T")

#: Upgrade refusals that may succeed on a later identical attempt.
TRANSIENT_UPGRADE_STATUSES: Final = frozenset({408, 425, 429})


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """Tunables of the stream reader (defaults = the TypeScript SDK's constants)."""

    backoff_initial_ms: int = 1_000
    backoff_cap_ms: int = 30_000
    max_consecutive_failures: int = 5
    open_timeout: float | None = 10.0
    ping_interval: float | None = 20.0
    ping_timeout: float | None = 20.0
    close_timeout: float | None = 2.0
    max_frame_bytes: int | None = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        self.policy()  # validate the backoff constants at construction

    def policy(self) -> BackoffPolicy:
        return BackoffPolicy(
            initial_ms=self.backoff_initial_ms,
            cap_ms=self.backoff_cap_ms,
            max_consecutive_failures=self.max_consecutive_failures,
        )


class _QuietLogger(logging.LoggerAdapter):  # type: ignore[type-arg,unused-ignore]
    """websockets' debug log prints handshake headers (the token): never enable it."""

    def isEnabledFor(self, level: int) -> bool:
        return level > logging.DEBUG and self.logger.isEnabledFor(level)


_WS_LOGGER: Final = _QuietLogger(logging.getLogger("coder_chat.stream.websockets"), {})
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _End:
    """Queue marker: the pump ended (``error`` None = closed by us)."""

    error: BaseException | None


class _Terminal(Exception):
    """Internal: a connection outcome that ends the reader."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _release_cancellation(task: asyncio.Future[Any]) -> None:
    """Done callback of a task that is cancelled and not awaited by anyone: take its
    ``CancelledError`` out of it.

    A cancelled task keeps that error until someone reads it; the error's traceback
    holds the task's frames, and their ``self`` holds the task — a reference cycle.
    A reader's pump (cancelled by :meth:`_PumpedReader.close_nowait`, waited for with
    ``asyncio.wait``) made one per stream, which kept the reader and all it held alive
    until the garbage collector's next pass, and websockets' keepalive task (cancelled
    when the connection is lost, never awaited) another with the error and its
    frames (docs/performance.md, round 11b). Read here, the error is dropped and the
    reader is freed when its last reference goes."""
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.exception()


class _PumpedReader(Generic[T]):
    """A background pump task feeding an ``asyncio.Queue``: reads never lose an
    item to a cancelled/timed-out caller, and the end of the pump is sticky."""

    _kind = "reader"

    def __init__(self, client: ChatClient) -> None:
        self._client = client
        self._queue: asyncio.Queue[T | _End] = asyncio.Queue()
        self._pump_task: asyncio.Task[None] | None = None
        self._end: _End | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose`/:meth:`close_nowait` was called."""
        return self._closed

    @property
    def failure(self) -> BaseException | None:
        """The terminal error, once the pump has failed and a read has observed it."""
        return self._end.error if self._end else None

    def start(self) -> None:
        """Spawn the pump (idempotent). Needs a running event loop."""
        if self._pump_task is not None or self._closed:
            return
        if self._client.closed:
            raise CoderAgentError("ChatClient is closed")
        self._pump_task = asyncio.get_running_loop().create_task(
            self._pump(), name=f"coder-chat-{self._kind}"
        )
        self._pump_task.add_done_callback(_release_cancellation)

    async def next_event(self, timeout: float | None = None) -> T | None:
        """The next item; ``None`` once closed by us.

        ``timeout`` (seconds) raises ``TimeoutError`` without losing anything;
        ``timeout=0`` only takes an already-arrived item. Raises the terminal
        error (sticky) after the items that preceded it.
        """
        if self._end is not None and self._queue.empty():
            self._raise_if_failed(self._end)
            return None
        self.start()
        item: T | _End
        if timeout is not None and timeout <= 0:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                raise TimeoutError("no stream event available") from None
        elif timeout is None:
            item = await self._queue.get()
        else:
            # asyncio.Queue.get takes the item only after its wait completes, so a
            # timeout or cancellation here leaves the item queued for the next read.
            async with asyncio.timeout(timeout):
                item = await self._queue.get()
        if isinstance(item, _End):
            self._end = item
            self._raise_if_failed(item)
            return None
        return item

    def next_event_nowait(self) -> T | None:
        """An already-arrived item or ``None`` (raises a stored terminal error)."""
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, _End):
            self._end = item
            self._raise_if_failed(item)
            return None
        return item

    @staticmethod
    def _raise_if_failed(end: _End) -> None:
        # The marker is sticky (kept in self._end): later reads end the same way.
        if end.error is not None:
            raise end.error

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            item = await self.next_event()
            if item is None:
                return
            yield item

    def close_nowait(self) -> None:
        """Close now without waiting: marks closed, cancels the pump (which closes
        the socket on its way out); pending and later reads get ``None``."""
        if self._closed:
            return
        self._closed = True
        task = self._pump_task
        if task is not None and not task.done():
            task.cancel()
        self._queue.put_nowait(_End(None))

    async def aclose(self) -> None:
        """Close and wait until the socket is closed (idempotent)."""
        self.close_nowait()
        task = self._pump_task
        if task is not None and not task.done():
            await asyncio.wait({task})

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _pump(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # every terminal outcome reaches the reader
            self._queue.put_nowait(_End(exc))

    async def _run(self) -> None:
        raise NotImplementedError


class ChatStreamReader(_PumpedReader[ChatStreamEvent]):
    """A retained, self-redialing reader of one chat's event stream."""

    _kind = "stream"

    def __init__(
        self,
        client: ChatClient,
        chat_id: str,
        after_id: int | None = None,
        *,
        options: StreamOptions | None = None,
        emitter: TransportEmitter | None = None,
    ) -> None:
        if not chat_id:
            raise CoderAgentError("a chat id is required to open its stream")
        if after_id is not None and after_id < 0:
            raise CoderAgentError("after_id must be a non-negative integer")
        super().__init__(client)
        self.chat_id = chat_id
        self.after_id = after_id if after_id else None
        self.options = options or StreamOptions()
        self.reader_id = next_reader_id()
        self._emitter = emitter if emitter is not None else client.emitter
        self._paused = False
        self._attempt = 0
        # Cleared when the server refuses a dial that carried a revision cursor (400):
        # from then on this reader resumes by after_id alone, as on B1.
        self._send_revision = True

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def attempt(self) -> int:
        """Number of dials so far (the current connection's attempt)."""
        return self._attempt

    def reusable_for(self, chat_id: str) -> bool:
        """May a resume segment attach? (not closed and the same chat; a stored
        failure still attaches, so the resume segment surfaces it)."""
        return not self._closed and self.chat_id == chat_id

    def pause(self) -> None:
        """Detach between segments; the pump keeps reading/redialing."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def __repr__(self) -> str:
        return (
            f"ChatStreamReader(chat_id={self.chat_id!r}, reader={self.reader_id}, "
            f"after_id={self.after_id!r}, attempt={self._attempt}, closed={self._closed}, "
            f"paused={self._paused})"
        )

    # ------------------------------------------------------------------ pump

    async def _run(self) -> None:
        budget = RedialBudget(self.options.policy())
        replay = ReplayFilter(self.after_id)
        last_failure: BaseException | None = None
        while True:
            self._attempt += 1
            attempt = self._attempt
            try:
                progressed, failure = await self._connect_once(attempt, replay, budget)
            except _Terminal as terminal:
                raise terminal.error from None
            if failure is not None:
                last_failure = failure
            url = self._client.stream_url(
                self.chat_id, self.after_id, history_version=self._revision(replay)
            )
            if replay.untrackable_outstanding:
                raise CoderStreamError(
                    f"Coder chat stream {self._client.stream_path(self.chat_id)} dropped "
                    "mid-turn and cannot be resumed: the server sent deltas without "
                    "history_version/generation_attempt/seq, so a redial would replay them",
                    url=url,
                    chat_id=self.chat_id,
                    cause=last_failure,
                )
            decision = budget.connection_ended(progressed=progressed)
            if decision.give_up:
                raise CoderStreamError(
                    f"Coder chat stream {self._client.stream_path(self.chat_id)} could not be "
                    f"(re-)established after {decision.consecutive_failures} consecutive "
                    "connection failures",
                    url=url,
                    chat_id=self.chat_id,
                    cause=last_failure,
                )
            self._emit_redial(attempt, decision.consecutive_failures, decision.backoff_ms)
            await asyncio.sleep(decision.backoff_ms / 1000.0)

    def _revision(self, replay: ReplayFilter) -> int | None:
        return replay.history_version if self._send_revision else None

    def _emit_redial(self, attempt: int, failures: int, backoff_ms: int) -> None:
        self._emitter.emit(
            lambda: WsRedial(
                chat_id=self.chat_id,
                reader=self.reader_id,
                attempt=attempt,
                consecutive_failures=failures,
                max_consecutive_failures=self.options.max_consecutive_failures,
                backoff_ms=backoff_ms,
            )
        )

    def _ws_error(self, attempt: int, message: str) -> None:
        self._emitter.emit(
            lambda: WsError(
                chat_id=self.chat_id, reader=self.reader_id, attempt=attempt, message=message
            )
        )

    def _ws_close(self, attempt: int, code: int | None, reason: str | None) -> None:
        self._emitter.emit(
            lambda: WsClose(
                chat_id=self.chat_id,
                reader=self.reader_id,
                attempt=attempt,
                code=code,
                reason=reason,
            )
        )

    async def _connect_once(
        self, attempt: int, replay: ReplayFilter, budget: RedialBudget
    ) -> tuple[bool, BaseException | None]:
        """One dial + read until the connection ends. Returns (progressed, failure);
        raises ``_Terminal`` for outcomes that must not be redialed."""
        preflight_error: BaseException | None = None
        if not self._client.prefix_locked:
            try:
                await self._client.ensure_prefix(op="streamEvents")
            except (CoderTransportError, TimeoutError, OSError) as exc:
                preflight_error = exc
        revision = self._revision(replay)
        url = self._client.stream_url(self.chat_id, self.after_id, history_version=revision)
        path = self._client.stream_path(self.chat_id)
        self._emitter.emit(
            lambda: WsDial(chat_id=self.chat_id, reader=self.reader_id, attempt=attempt, url=url)
        )
        if preflight_error is not None:
            self._ws_error(attempt, f"prefix preflight failed: {preflight_error}")
            self._ws_close(attempt, None, None)
            return False, preflight_error

        opts = self.options
        try:
            ws = await _dial(self._client, url, opts)
        except InvalidStatus as exc:
            status = exc.response.status_code
            message, detail = _upgrade_envelope(exc.response.body, status)
            self._ws_error(attempt, f"upgrade rejected with HTTP {status}: {message}")
            self._ws_close(attempt, None, None)
            if status == 400 and revision is not None:
                # A build that rejects the revision cursor we learnt from it (B3:
                # "Invalid history_version parameter.") must not end the turn: the
                # cursor is an optimisation, after_id alone is always correct.
                self._send_revision = False
                return False, CoderApiError(status, "GET", path, message, detail)
            if 400 <= status < 500 and status not in TRANSIENT_UPGRADE_STATUSES:
                raise _Terminal(CoderApiError(status, "GET", path, message, detail)) from None
            return False, CoderApiError(status, "GET", path, message, detail)
        except (OSError, TimeoutError, WebSocketException) as exc:
            text = f"{type(exc).__name__}: {exc}"
            self._ws_error(attempt, text)
            self._ws_close(attempt, None, None)
            return False, ConnectionError(text)
        except BaseException:
            self._ws_close(attempt, None, None)  # closed by us while dialing
            raise

        self._emitter.emit(
            lambda: WsOpen(chat_id=self.chat_id, reader=self.reader_id, attempt=attempt)
        )
        progressed = False
        failure: BaseException | None = None
        remote_closed = False
        try:
            while True:
                try:
                    raw = await ws.recv()
                except ConnectionClosed as exc:
                    remote_closed = True
                    code = ws.close_code
                    if code not in (1000, 1001):
                        text = f"chat stream connection lost (code {code}): {exc}"
                        self._ws_error(attempt, text)
                        failure = ConnectionError(text)
                    else:
                        failure = ConnectionError(f"chat stream closed by the server (code {code})")
                    break
                progressed = self._ingest(raw, attempt, replay, budget) or progressed
        except _Terminal:
            await self._close_socket(ws)
            self._ws_close(attempt, None, None)
            raise
        except BaseException:
            # Cancelled (aclose) or an unexpected bug: close our side, report once.
            await self._close_socket(ws)
            self._ws_close(attempt, None, None)
            raise
        code, reason = (ws.close_code, ws.close_reason) if remote_closed else (None, None)
        await self._close_socket(ws)
        self._ws_close(attempt, code, reason)
        return progressed, failure

    def _ingest(
        self, raw: str | bytes, attempt: int, replay: ReplayFilter, budget: RedialBudget
    ) -> bool:
        try:
            events = parse_frame(raw)
        except ValueError as exc:
            self._ws_error(attempt, f"unparseable chat stream frame: {type(exc).__name__}")
            error = CoderAgentError("failed to parse chat stream frame")
            error.__cause__ = exc
            raise _Terminal(error) from None
        progressed = False
        for event in events:
            verdict = replay.observe(event)
            self._emitter.emit(
                lambda event=event, verdict=verdict: WsEvent(  # type: ignore[misc]
                    chat_id=self.chat_id,
                    reader=self.reader_id,
                    attempt=attempt,
                    event=event,
                    forwarded=verdict.forward,
                )
            )
            if verdict.progress:
                budget.progress()
                progressed = True
            if verdict.forward:
                self._queue.put_nowait(event)
        return progressed

    @staticmethod
    async def _close_socket(ws: ClientConnection) -> None:
        with contextlib.suppress(Exception):
            await ws.close()


class ChatWatcher(_PumpedReader[ChatWatchEvent]):
    """``/chats/watch``: lifecycle events of every chat visible to the token.

    Same read API as :class:`ChatStreamReader` (``next_event``, async iteration,
    ``aclose``). Redials forever with ``backoff_initial_ms`` doubling to
    ``backoff_cap_ms``, reset by any event (there is no cursor and no replay, so
    reconcile against :meth:`ChatClient.iter_chats` after a gap). An upgrade
    refused with a 4xx other than 408/425/429 (bad token, a server without the
    endpoint) raises :class:`~coder_chat.errors.CoderApiError`. An unparseable
    frame is skipped (nothing is replayed, so skipping loses only that event).
    Not instrumented with ``ws:*`` transport events (as in the TypeScript SDK);
    the prefix preflight, when needed, reports op ``watchChats``.
    """

    _kind = "watch"

    def __init__(self, client: ChatClient, *, options: StreamOptions | None = None) -> None:
        super().__init__(client)
        self.options = options or StreamOptions()

    def __repr__(self) -> str:
        return f"ChatWatcher(base_url={self._client.base_url!r}, closed={self._closed})"

    async def _run(self) -> None:
        opts = self.options
        backoff_ms = opts.backoff_initial_ms
        while True:
            try:
                if not self._client.prefix_locked:
                    await self._client.ensure_prefix(op="watchChats")
                url = self._client.watch_url()
                ws = await _dial(self._client, url, opts)
            except InvalidStatus as exc:
                status = exc.response.status_code
                if 400 <= status < 500 and status not in TRANSIENT_UPGRADE_STATUSES:
                    message, detail = _upgrade_envelope(exc.response.body, status)
                    path = f"{self._client.prefix}/watch"
                    raise CoderApiError(status, "GET", path, message, detail) from None
            except (OSError, TimeoutError, WebSocketException, CoderTransportError):
                pass
            else:
                try:
                    async for raw in ws:
                        try:
                            event = ChatWatchEvent.model_validate_json(raw)
                        except ValueError:
                            _log.debug("skipping an unparseable watch frame")
                            continue
                        backoff_ms = opts.backoff_initial_ms
                        self._queue.put_nowait(event)
                except ConnectionClosed:
                    pass
                finally:
                    with contextlib.suppress(Exception):
                        await ws.close()
            await asyncio.sleep(backoff_ms / 1000.0)
            backoff_ms = min(backoff_ms * 2, opts.backoff_cap_ms)


class _StreamConnection(ClientConnection):
    """websockets' client connection (``connect(create_connection=...)``), without its
    reference cycle once the connection is lost.

    websockets wraps the connection's logger in a ``LoggerAdapter`` whose ``extra``
    names the connection (connection → adapter → connection), so every closed
    connection — its protocol, handshake, transport, socket, keepalive task and that
    task's context (the turn's Prefect run context and transport hook) — waited for
    the garbage collector; per turn of a fan-out worker ≈ 115 objects that survived
    into the older generations (docs/performance.md, round 11b). Once the connection
    is lost only its close bookkeeping can still log, and it does so through the
    plain logger."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        adapter = self.protocol.logger
        if (
            isinstance(adapter, logging.LoggerAdapter)
            and adapter.extra is not None
            and adapter.extra.get("websocket") is self
        ):
            self.logger = self.protocol.logger = adapter.logger


async def _dial(client: ChatClient, url: str, opts: StreamOptions) -> ClientConnection:
    """Open one WebSocket the way every reader does: token in the upgrade header only,
    the stream options' bounds, TLS verification as the client's, quiet logging."""
    ws = await connect(
        url,
        additional_headers=client.auth_headers(),
        open_timeout=opts.open_timeout,
        ping_interval=opts.ping_interval,
        ping_timeout=opts.ping_timeout,
        close_timeout=opts.close_timeout,
        max_size=opts.max_frame_bytes,
        # wss only (websockets rejects an ssl argument for ws://); the shared
        # context spares every dial a CA-bundle load and trusts what REST trusts.
        ssl=client.ssl_context if url.startswith("wss://") else None,
        logger=_WS_LOGGER,
        compression=None,
        create_connection=_StreamConnection,
        # The environment's proxy for this host, read once per client (not per dial).
        proxy=client.ws_proxy(url),
    )
    # Cancelled by websockets when the connection is lost, and never awaited.
    if ws.keepalive_task is not None:
        ws.keepalive_task.add_done_callback(_release_cancellation)
    return ws


def _upgrade_envelope(body: bytes | bytearray | None, status: int) -> tuple[str, str | None]:
    try:
        data: Any = json.loads(body) if body else None
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("message"), str) and data["message"]:
        detail = data.get("detail")
        return data["message"], detail if isinstance(detail, str) and detail else None
    return f"WebSocket upgrade rejected (HTTP {status})", None

"""WebSocket sessions: one ``/stream`` reader (snapshot + live events) and one ``/watch`` reader.

A session owns its socket: it syncs its cursor against the chat whenever the core hints a
change, frames the events, sends pings, and honours the stream faults (drop, stall).

``routes.py`` opens the sessions; what a session needs from it is ``SessionHost`` (the
core, and the registry of open streams that the drop faults walk), so this module never
imports ``routes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Protocol

from .core import Core, WatchSub
from .httpserver import WebSocket
from .store import ChatRec, User
from .stream import StreamCursor, frames

_LOG = logging.getLogger("coder_chat.emulator.sessions")


class SessionHost(Protocol):
    """What a session needs from the API that opened it (``routes.Api``)."""

    @property
    def core(self) -> Core:
        """The emulated deployment."""
        ...

    @property
    def sessions(self) -> set[StreamSession]:
        """Every open ``/stream`` session (a session adds itself while it runs)."""
        ...


class StreamSession:
    """One open ``/stream`` WebSocket."""

    def __init__(self, api: SessionHost, chat: ChatRec, user: User, cursor: StreamCursor) -> None:
        self.api = api
        self.core = api.core
        self.chat = chat
        self.user = user
        self.cursor = cursor
        self._wake = asyncio.Event()
        self.ws: WebSocket | None = None
        self.frames_left: int | None = None
        self.drop_code: int | None = None
        self.frames_sent = 0
        self.events_sent = 0
        self._closer: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Pubsub hint: the chat changed."""
        self._wake.set()

    def arm_drop(self, frames: int, code: int | None) -> None:
        """Drop after ``frames`` more frames (0 = now)."""
        self.frames_left = frames
        self.drop_code = code
        if frames <= 0:
            self.drop(code)

    def drop(self, code: int | None) -> None:
        """Drop the connection now (abort TCP, or close with ``code``)."""
        ws = self.ws
        if ws is None:
            return
        self.core.log("fault", self.chat.id, fault="drop_stream", code=code)
        if code is None:
            ws.abort()
        else:
            self._closer = asyncio.get_running_loop().create_task(ws.close(code, ""))
        self._wake.set()

    async def _unstalled(self) -> None:
        while True:
            until = self.core.faults.stalled_until(self.chat.id)
            if until is False:
                return
            if self.ws is None or self.ws.closed.is_set():
                return
            await asyncio.sleep(0.02)

    async def run(self, ws: WebSocket) -> None:
        """Send snapshot + live events until the socket closes."""
        self.ws = ws
        chat, core = self.chat, self.core
        chat.subscribers.add(self)
        self.api.sessions.add(self)
        core.log("ws_connect", chat.id, after_id=self.cursor.after_id, user=self.user.username)
        if chat.owner.id == self.user.id:
            chat.has_unread = False
        rule = core.faults.take_drop(chat.id)
        if rule is not None:
            self.arm_drop(rule.frames, rule.code)
        pinger = asyncio.get_running_loop().create_task(self._ping_loop())
        closed_waiter = asyncio.get_running_loop().create_task(self._watch_closed())
        try:
            while not ws.closed.is_set():
                self._wake.clear()
                if core.faults.stalled_until(chat.id) is not False:
                    await self._unstalled()
                    continue
                events = self.cursor.sync(chat)
                for frame in frames(events):
                    if ws.closed.is_set():
                        break
                    await ws.send_text(json.dumps(frame, separators=(",", ":")).encode() + b"\n")
                    self.frames_sent += 1
                    self.events_sent += len(frame)
                    if self.frames_left is not None:
                        self.frames_left -= 1
                        if self.frames_left <= 0:
                            self.frames_left = None
                            self.drop(self.drop_code)
                            break
                if ws.closed.is_set():
                    break
                await self._wake.wait()
        except (ConnectionError, OSError) as exc:
            # The reader went away (or a drop fault closed it) mid-send: a normal end.
            _LOG.debug("stream of chat %s ended: %r", chat.id, exc)
        finally:
            pinger.cancel()
            closed_waiter.cancel()
            chat.subscribers.discard(self)
            self.api.sessions.discard(self)
            if chat.owner.id == self.user.id:
                chat.has_unread = False
            core.log("ws_disconnect", chat.id, frames=self.frames_sent)

    async def _watch_closed(self) -> None:
        assert self.ws is not None
        await self.ws.closed.wait()
        self._wake.set()

    async def _ping_loop(self) -> None:
        ws = self.ws
        assert ws is not None
        interval = self.core.cfg.ping_interval
        with contextlib.suppress(ConnectionError, OSError):
            while not ws.closed.is_set():
                await asyncio.sleep(interval)
                if self.core.faults.stalled_until(self.chat.id) is not False:
                    continue
                if not await ws.ping(self.core.cfg.ping_timeout):
                    if not ws.closed.is_set():
                        await ws.close(1001, "liveness probe failed")
                    return


class WatchSession:
    """One open ``/chats/watch`` WebSocket: one JSON object per frame."""

    def __init__(self, api: SessionHost, user: User) -> None:
        self.api = api
        self.user = user

    async def run(self, ws: WebSocket) -> None:
        """Forward watch events until the socket closes."""
        core = self.api.core
        sub = WatchSub(self.user)
        core.watchers.add(sub)
        core.log("watch_connect", None, user=self.user.username)
        closed = asyncio.get_running_loop().create_task(ws.closed.wait())
        getter: asyncio.Task[dict[str, Any]] | None = None
        try:
            while not ws.closed.is_set():
                getter = asyncio.get_running_loop().create_task(sub.queue.get())
                done, _ = await asyncio.wait({getter, closed}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                ev = getter.result()
                await ws.send_text(json.dumps(ev).encode() + b"\n")
        except (ConnectionError, OSError) as exc:
            _LOG.debug("watch ended: %r", exc)
        finally:
            # Cancelled mid-wait (the server stops or restarts): the getter task must
            # end with us, or it stays pending on this loop until the loop closes and
            # its coroutine is collected later, on a closed loop (an unraisable error).
            if getter is not None:
                getter.cancel()
            closed.cancel()
            core.watchers.discard(sub)
            with contextlib.suppress(Exception):
                core.log("watch_disconnect", None, user=self.user.username)

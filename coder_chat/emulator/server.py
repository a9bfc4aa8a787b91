"""The :class:`Emulator` handle: starts the server, exposes faults, scripts, introspection.

Two ways to run it:

* ``async with Emulator(...) as emu:`` — in the current event loop.
* ``with Emulator.running_in_thread(...) as emu:`` — on its own loop in a daemon thread, so
  synchronous code, Prefect flows in worker threads and subprocesses can all reach it.

Every handle method is thread-safe: it runs on the server loop (directly when called from
that loop, otherwise marshalled with ``run_coroutine_threadsafe``).

``control.py`` is this handle's HTTP face (``/__emulator__/…``, one route per handle
method); the two are one idea kept in two files, which is why ``control.py`` names
``Emulator`` for its types.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from .config import Config
from .control import PREFIX, handle_control
from .core import Core
from .eras import Era, default_era
from .eras import era as resolve_era
from .faults import DropRule, RestFault, RouteRemoval, Stall, UpgradeRefusal
from .httpserver import DropResponse, HttpServer, Request, Response, Upgrade
from .routes import Api
from .script import Script
from .statemachine import Refused
from .store import User, new_uuid
from .views import chat_info, messages_info

T = TypeVar("T")


def _as_script(script: Script | dict[str, Any] | list[Any] | str | None) -> Script | None:
    if script is None or isinstance(script, Script):
        return script
    return Script.from_json(script)


class Faults:
    """In-process fault handle (``emu.faults``); see docs/emulator.md for semantics."""

    def __init__(self, emu: Emulator) -> None:
        self._emu = emu

    def drop_stream(
        self, chat_id: str | None = None, *, after_frames: int = 0, code: int | None = None
    ) -> int:
        """Drop every stream open now (of ``chat_id``, or all) after ``after_frames`` more
        frames (0 = now). ``code=None`` aborts TCP (no close frame); else close with it.
        Returns how many streams were armed."""

        def run() -> int:
            api = self._emu._api_checked()
            n = 0
            for s in list(api.sessions):
                if chat_id is None or s.chat.id == chat_id:
                    s.arm_drop(after_frames, code)
                    n += 1
            return n

        return self._emu._call(run)

    def drop_next_stream(
        self,
        chat_id: str | None = None,
        *,
        after_frames: int = 0,
        count: int = 1,
        code: int | None = None,
    ) -> None:
        """The next ``count`` stream connections are dropped after ``after_frames`` frames."""
        self._emu._call(
            lambda: self._faults().drops.append(DropRule(after_frames, count, chat_id, code))
        )

    def refuse_upgrades(
        self,
        status: int = 503,
        *,
        seconds: float | None = None,
        count: int | None = None,
        chat_id: str | None = None,
        path: str | None = None,
    ) -> None:
        """Refuse WebSocket upgrades with HTTP ``status`` for ``seconds`` or ``count`` dials
        (both None = until cleared)."""
        until = None if seconds is None else time.monotonic() + float(seconds)
        self._emu._call(
            lambda: self._faults().upgrades.append(
                UpgradeRefusal(status, until, count, chat_id, path)
            )
        )

    def stall_stream(self, chat_id: str | None = None, *, seconds: float | None = None) -> None:
        """Send no frames and no pings on matching streams (open or new) for ``seconds``
        (None = until :meth:`unstall` / :meth:`clear`)."""
        until = None if seconds is None else time.monotonic() + float(seconds)
        self._emu._call(lambda: self._faults().stalls.append(Stall(chat_id, until)))

    def unstall(self) -> None:
        """End every stall."""
        self._emu._call(lambda: self._faults().stalls.clear())

    def fail_rest(
        self,
        count: int = 1,
        *,
        status: int = 503,
        method: str | None = None,
        path: str | None = None,
        message: str | None = None,
    ) -> None:
        """Fail the next ``count`` matching REST calls with ``status`` (nothing committed).
        ``path`` is a substring match on the request path. The error envelope's
        ``message`` defaults to the status's reason phrase (503 → "Service Unavailable")."""
        self._emu._call(
            lambda: self._faults().rest.append(
                RestFault("fail", count, method, path, status, message)
            )
        )

    def drop_response(
        self, count: int = 1, *, method: str | None = "POST", path: str | None = None
    ) -> None:
        """Run the next ``count`` matching requests (they commit) but close the connection
        without a response: the "landed, response lost" window."""
        self._emu._call(
            lambda: self._faults().rest.append(RestFault("drop_response", count, method, path))
        )

    def delay_commit(
        self,
        seconds: float,
        *,
        count: int = 1,
        method: str | None = "POST",
        path: str | None = None,
    ) -> None:
        """Hold the next ``count`` matching requests ``seconds`` before they commit."""
        self._emu._call(
            lambda: self._faults().rest.append(
                RestFault("delay_commit", count, method, path, seconds=float(seconds))
            )
        )

    def hold_commit(
        self,
        *,
        until_path: str | None,
        until_method: str | None = "GET",
        until_count: int = 1,
        count: int = 1,
        method: str | None = "POST",
        path: str | None = None,
        max_seconds: float = 60.0,
    ) -> None:
        """Hold the next ``count`` matching requests before they commit until
        ``until_count`` more requests matching ``until_method``/``until_path`` arrive:
        the held request commits right before the last of them is served (or after
        ``max_seconds``). Orders a late commit between two reads, deterministically."""
        fault = RestFault(
            "hold_commit",
            count,
            method,
            path,
            seconds=float(max_seconds),
            until_method=until_method,
            until_path=until_path,
            until_count=until_count,
        )
        self._emu._call(lambda: self._faults().rest.append(fault))

    def remove_route(self, path: str, *, method: str | None = None) -> None:
        """Answer 404 ``Route not found.`` to every request (REST or WebSocket upgrade)
        whose path contains ``path`` (and whose method is ``method``, when given), before
        auth: the server then behaves like a build that does not serve that route
        (e.g. ``"/stream"``, ``"/chats/models"``, ``"/api/v2/chats"``). Until
        :meth:`clear`."""
        self._emu._call(lambda: self._faults().removed.append(RouteRemoval(path, method)))

    def restart(self, downtime: float = 0.0) -> Any:
        """Close the listener and every connection, reopen on the same port after
        ``downtime`` seconds; all state is kept. Blocks until reopened when called from
        another thread; on the server loop it returns a Task to await."""
        return self._emu.restart(downtime)

    def clear(self) -> None:
        """Disarm every fault."""
        self._emu._call(lambda: self._faults().clear())

    def _faults(self) -> Any:
        return self._emu._core_checked().faults


class Emulator:
    """A local chatd deployment speaking the Coder chat wire protocol."""

    def __init__(
        self,
        tokens: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        admin_token: str | None = None,
        organization_id: str | None = None,
        requires_action_timeout: float = 300.0,
        ping_interval: float = 15.0,
        ping_timeout: float = 15.0,
        queue_cap: int = 20,
        delta_count: int = 5,
        delta_delay: float = 0.005,
        commit_delay: float = 0.0,
        interrupt_wind_down: float = 0.02,
        max_concurrent_root_chats: int | None = None,
        clock: Callable[[], float] = time.time,
        log_requests: bool = True,
        stamp_queued_message_id: bool | None = None,
        aibridge_providers: dict[str, str] | None = None,
        era: str | Era | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """Configure (not start) an emulator; ``era`` picks the server build to play
        (``"b1"``, ``"b2"``, ``"b3"``; None: ``$CODER_CHAT_EMULATOR_ERA`` or the default,
        see docs/emulator.md); ``tls``, a server-side ``SSLContext``, serves ``https`` and
        ``wss`` instead of plain HTTP. Every other keyword is documented in
        docs/emulator.md's configuration table."""
        toks = list(tokens) if tokens else [f"emu-{secrets.token_hex(16)}"]
        self._users = [
            User(
                str(uuid.uuid5(uuid.NAMESPACE_URL, f"emu-user-{i}-{t}")),
                "admin" if i == 0 else f"user{i}",
                t,
            )
            for i, t in enumerate(toks)
        ]
        self.host = host
        self._port = port
        self.admin_token = admin_token or f"emu-admin-{secrets.token_hex(16)}"
        self.organization_id = organization_id or new_uuid()
        self._cfg = Config(
            requires_action_timeout=requires_action_timeout,
            ping_interval=ping_interval,
            ping_timeout=ping_timeout,
            queue_cap=queue_cap,
            delta_count=delta_count,
            delta_delay=delta_delay,
            commit_delay=commit_delay,
            interrupt_wind_down=interrupt_wind_down,
            max_concurrent_root_chats=max_concurrent_root_chats,
            clock=clock,
            log_requests=log_requests,
            stamp_queued_message_id=stamp_queued_message_id,
            aibridge_providers=aibridge_providers,
            era=resolve_era(era if era is not None else default_era()),
        )
        self._tls = tls
        self._core: Core | None = None
        self._api: Api | None = None
        self._http: HttpServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.faults = Faults(self)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Bind and start serving on the current loop."""
        self._loop = asyncio.get_running_loop()
        self._core = Core(self._cfg, self._users, self.organization_id)
        self._api = Api(self._core)
        self._http = HttpServer(self._handle, self.host, self._port, tls=self._tls)
        await self._http.start()
        self._port = self._http.port
        self._core.log("server_start", None, port=self._port)

    async def stop(self) -> None:
        """Close every connection, stop workers."""
        if self._http is not None:
            await self._http.stop()
        if self._core is not None:
            await self._core.aclose()

    async def __aenter__(self) -> Emulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @classmethod
    @contextlib.contextmanager
    def running_in_thread(cls, *args: Any, **kwargs: Any) -> Iterator[Emulator]:
        """Run an emulator on its own event loop in a daemon thread."""
        emu = cls(*args, **kwargs)
        ready = threading.Event()
        state: dict[str, Any] = {}

        def target() -> None:
            loop = asyncio.new_event_loop()
            state["loop"] = loop

            async def main() -> None:
                stop = asyncio.Event()
                state["stop"] = stop
                try:
                    await emu.start()
                except BaseException as exc:  # surface bind errors to the caller
                    state["error"] = exc
                    ready.set()
                    return
                ready.set()
                await stop.wait()
                await emu.stop()

            try:
                loop.run_until_complete(main())
            finally:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        th = threading.Thread(target=target, name="chatd-emulator", daemon=True)
        th.start()
        if not ready.wait(10) or "error" in state:
            raise RuntimeError(f"emulator failed to start: {state.get('error')!r}")
        try:
            yield emu
        finally:
            loop = state["loop"]
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(state["stop"].set)
            th.join(10)

    # ----------------------------------------------------------------- plumbing
    async def _handle(self, req: Request) -> Response | DropResponse | Upgrade:
        if req.path.startswith(PREFIX + "/") or req.path == PREFIX:
            return await handle_control(self, req)
        return await self._api_checked().handle(req)

    def _core_checked(self) -> Core:
        if self._core is None:
            raise RuntimeError("emulator is not running")
        return self._core

    def _api_checked(self) -> Api:
        if self._api is None:
            raise RuntimeError("emulator is not running")
        return self._api

    def _call(self, fn: Callable[[], T]) -> T:
        loop = self._loop
        if loop is None:
            raise RuntimeError("emulator is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return fn()

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=30)

    def _chat_rec(self, chat_id: str) -> Any:
        chat = self._core_checked().chats.get(str(chat_id))
        if chat is None:
            raise KeyError(f"no chat {chat_id}")
        return chat

    # ------------------------------------------------------------------ handle
    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT`` (``https://`` when serving TLS)."""
        return f"{'https' if self._tls else 'http'}://{self.host}:{self._port}"

    @property
    def ws_url(self) -> str:
        """``ws://HOST:PORT`` (``wss://`` when serving TLS)."""
        return f"{'wss' if self._tls else 'ws'}://{self.host}:{self._port}"

    @property
    def token(self) -> str:
        """The default (first) user's session token."""
        return self._users[0].token

    @property
    def tokens(self) -> dict[str, dict[str, str]]:
        """token → ``{"id", "username"}`` for every user."""
        return {u.token: {"id": u.id, "username": u.username} for u in self._users}

    @property
    def users(self) -> list[dict[str, str]]:
        """Users as ``{"id", "username", "token"}``."""
        return [{"id": u.id, "username": u.username, "token": u.token} for u in self._users]

    @property
    def state(self) -> Emulator:
        """Introspection namespace (the handle itself: ``chats()``, ``messages()``, …)."""
        return self

    @property
    def era(self) -> str:
        """The server build this emulator plays: ``"b1"``, ``"b2"`` or ``"b3"``."""
        return self._cfg.era.name

    @property
    def config(self) -> Config:
        """The live config (mutating it affects later behaviour)."""
        return self._cfg

    def add_user(self, token: str, username: str | None = None) -> dict[str, str]:
        """Add a user with ``token`` at run time."""

        def run() -> dict[str, str]:
            core = self._core_checked()
            u = User(new_uuid(), username or f"user{len(core.users)}", token)
            core.users.append(u)
            core.users_by_token[token] = u
            return {"id": u.id, "username": u.username, "token": u.token}

        return self._call(run)

    def share_chat(self, chat_id: str, username: str) -> None:
        """Give another user read access (GET/stream; mutations get 403/404)."""

        def run() -> None:
            core = self._core_checked()
            u = next(u for u in core.users if u.username == username or u.token == username)
            self._chat_rec(chat_id).shared_with.add(u.id)

        self._call(run)

    def script_next_turn(
        self, chat_id: str, script: Script | dict[str, Any] | list[Any] | str
    ) -> None:
        """Script the chat's next turn (FIFO if called several times)."""
        s = _as_script(script)
        assert s is not None
        self._call(lambda: self._chat_rec(chat_id).next_scripts.append(s))

    def set_chat_script(
        self, chat_id: str, script: Script | dict[str, Any] | list[Any] | str | None
    ) -> None:
        """Script every later turn of the chat (None restores the default)."""
        s = _as_script(script)

        def run() -> None:
            self._chat_rec(chat_id).chat_script = s

        self._call(run)

    def set_default_script(self, script: Script | dict[str, Any] | list[Any] | str | None) -> None:
        """Script every turn without a more specific script (None = echo)."""
        s = _as_script(script)

        def run() -> None:
            self._core_checked().default_script = s

        self._call(run)

    def expire_requires_action(self, chat_id: str) -> bool:
        """Fire the requires_action deadline now; True when the chat was waiting."""
        return self._call(lambda: self._core_checked().expire_requires_action(str(chat_id)))

    def end_sleeps(self, chat_id: str | None = None) -> int:
        """End every scripted ``sleep`` in progress (on ``chat_id``'s turn, or on all)
        as if its time had passed: the turn goes on to its next part, nothing is
        interrupted. Returns how many sleeps ended (each is logged ``sleep_ended``).

        Drives model time from a test: script a long sleep to hold a turn running for
        as long as the test needs (no race against a short one), then end it."""
        return self._call(
            lambda: self._core_checked().end_sleeps(None if chat_id is None else str(chat_id))
        )

    def chats(self) -> list[dict[str, Any]]:
        """Every chat (incl. archived) with execution details."""
        return self._call(
            lambda: [chat_info(c, self._cfg.queue_cap) for c in self._core_checked().chats.values()]
        )

    def chat(self, chat_id: str) -> dict[str, Any]:
        """One chat: wire fields plus ``queue``, ``execution_state``, ``history_version`` …"""
        return self._call(lambda: chat_info(self._chat_rec(chat_id), self._cfg.queue_cap))

    def messages(self, chat_id: str, include_system: bool = True) -> list[dict[str, Any]]:
        """Stored rows oldest first (with ``visibility`` and ``revision``)."""
        return self._call(lambda: messages_info(self._chat_rec(chat_id), include_system))

    def event_log(self, kinds: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The event log: dicts with ``time``, ``mono``, ``kind``, ``chat_id``, ``details``."""

        def run() -> list[dict[str, Any]]:
            log = self._core_checked().event_log
            if kinds:
                return [dict(e) for e in log if e["kind"] in kinds]
            return [dict(e) for e in log]

        return self._call(run)

    def max_concurrent_turns(self) -> int:
        """Highest number of simultaneously running turns seen in the event log."""
        return max((e["details"]["running"] for e in self.event_log(["turn_start"])), default=0)

    def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005
    ) -> None:
        """Block (from a non-loop thread) until ``predicate()`` holds; TimeoutError if not."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not reached")
            time.sleep(interval)

    def wait_for_status(self, chat_id: str, status: str, timeout: float = 5.0) -> None:
        """Block until the chat has ``status`` (from a non-loop thread)."""
        self.wait_for(lambda: self.chat(chat_id)["status"] == status, timeout)

    async def await_status(self, chat_id: str, status: str, within: float = 5.0) -> None:
        """Async wait for a chat status (any loop)."""
        deadline = time.monotonic() + within
        while self.chat(chat_id)["status"] != status:
            if time.monotonic() > deadline:
                raise TimeoutError(f"chat {chat_id} never reached {status}")
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------ restart
    async def arestart(self, downtime: float = 0.0) -> None:
        """Restart the listener on the same port, keeping all state."""
        http = self._http
        core = self._core_checked()
        assert http is not None
        core.log("restart", None, downtime=downtime)
        await http.stop()
        if downtime:
            await asyncio.sleep(downtime)
        await http.start()
        core.log("restarted", None, port=http.port)

    def restart(self, downtime: float = 0.0) -> Any:
        """Restart (see :meth:`Faults.restart`)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("emulator is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return loop.create_task(self.arestart(downtime))
        asyncio.run_coroutine_threadsafe(self.arestart(downtime), loop).result(timeout=30)
        return None


__all__ = ["Emulator", "Faults", "Refused"]

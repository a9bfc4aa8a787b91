# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""REST client of the chatd API (agent-semantics §1, chatd-wire §1).

:class:`ChatClient` holds one pooled ``httpx.AsyncClient`` and speaks every
chat route the agent, the sweeps and the blocks need. One module although it is
long: every route shares the same request path (prefix lock, auth, error mapping,
transport events, per-call deadline), and each route is a few lines over it —
splitting them by route would scatter that one idea. Notes for users:

* **Prefix.** Chat routes live under ``/api/v2/chats`` (newer servers) or
  ``/api/experimental/chats`` (older). Until the prefix is *locked*, a chat
  request goes to v2 and, only on HTTP 404, is retried once on the
  experimental prefix. The first non-404 response (2xx or error) locks the
  prefix it came from for the client's lifetime; two 404s raise the v2 error
  and do not lock; network errors never lock. :meth:`ChatClient.ensure_prefix`
  is the WebSocket preflight (``GET /api/v2/chats?limit=1``). Builds B1/B2 serve
  both prefixes and B3 only v2, where the experimental retry is a 404 too: a B3
  client therefore never locks the experimental prefix.
* **Auth.** Header ``Coder-Session-Token`` on every request (never in a URL).
  The token is a ``SecretStr`` inside the client; ``repr``/``str`` of the
  client, of its errors and of its transport events never contain it.
  Redirects are not followed, so the header never travels to another host.
* **Errors.** A non-2xx response raises :class:`~coder_chat.errors.CoderApiError`
  with the Coder envelope's ``message``/``detail``. A network failure raises
  :class:`~coder_chat.errors.CoderTransportError` (method, URL, ``retry_safe``,
  the setting to check), and httpx's own connect/read/write/pool timeout its
  subclass :class:`~coder_chat.errors.CoderTimeoutError` (also a builtin
  ``TimeoutError``); neither keeps the httpx object, whose request holds the
  auth header. The per-call ``timeout=`` deadline (covering the whole call,
  both prefix tries included) raises the builtin ``TimeoutError``. A caller's
  own ``asyncio.timeout``/cancellation propagates unchanged.
* **Transport events.** ``http:request``/``http:response``/``http:error`` with
  a per-client ``id`` counter and the spec's ``op`` names; paths only.
* **Listing.** :meth:`ChatClient.list_chats` is one page (a bare array);
  :meth:`ChatClient.iter_chats` pages by ``offset`` until a short page, per
  archived state (``q=archived:false`` / ``archived:true``; ``archived=None``
  walks both, which works on every server build).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self
from urllib.parse import quote, urlencode, urlsplit
from urllib.request import getproxies

import httpx
from pydantic import SecretStr
from websockets.proxy import get_proxy
from websockets.uri import parse_uri

from coder_chat.errors import (
    IDEMPOTENT_METHODS,
    CoderAgentError,
    CoderApiError,
    CoderTimeoutError,
    CoderTransportError,
)
from coder_chat.events import (
    HttpError,
    HttpRequest,
    HttpResponse,
    TransportEmitter,
    TransportEventHandler,
)
from coder_chat.models import (
    Chat,
    ChatMessagesResponse,
    CreateChatMessageRequest,
    CreateChatMessageResponse,
    CreateChatRequest,
    ToolResult,
    UpdateChatRequest,
)
from coder_chat.settings import CoderSettings

__all__ = ["EXPERIMENTAL_PREFIX", "TOKEN_HEADER", "V2_PREFIX", "ChatClient", "shared_ssl_context"]

V2_PREFIX: Final = "/api/v2/chats"
EXPERIMENTAL_PREFIX: Final = "/api/experimental/chats"
TOKEN_HEADER: Final = "Coder-Session-Token"
_USER_AGENT: Final = "prefect-coder/coder_chat"
#: Parsed request URLs a client keeps (cleared when full).
_URL_CACHE_SIZE: Final = 256


@functools.cache
def shared_ssl_context(verify: bool) -> ssl.SSLContext:
    """The process-wide TLS context for ``verify`` (REST and WebSocket alike).

    Building one loads the CA bundle (≈ 30-40 ms); doing it per client made every
    ``ChatClient`` (and every ``wss`` dial) pay that. One context per setting is
    shared instead; ``SSLContext`` is safe to share across connections, threads
    and event loops. It is httpx's own default context (certifi, or
    ``SSL_CERT_FILE``/``SSL_CERT_DIR``), so REST and the stream trust the same
    CAs. Do not mutate it: every client in the process uses it.
    """
    return httpx.create_ssl_context(verify=verify)


@functools.cache
def _plain_http_context() -> ssl.SSLContext:
    """The TLS context of a pool that only ever speaks plain ``http``.

    httpx builds a transport's context when the transport is built; certifi's bundle
    costs ≈ 60 ms of CPU, paid for nothing by every process whose Coder URL is
    ``http://`` (docs/performance.md, round 10d). This one loads no CA at all yet
    still requires a verified certificate and hostname, so a TLS connection through
    it could only fail, never go unverified.
    """
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def _seg(value: str | int) -> str:
    """Quote one path segment (ids are uuids/ints; never let a '/' through)."""
    return quote(str(value), safe="")


class ChatClient:
    """Async REST client for chatd. Use as ``async with ChatClient(...) as c:``.

    ``http_client`` lets a caller share a pool; the client then does not close
    it. ``timeout`` is the default per-request httpx timeout; every method
    takes ``timeout=`` as a per-call deadline for the whole call.
    """

    def __init__(
        self,
        base_url: str,
        token: SecretStr | str,
        *,
        organization_id: str | None = None,
        timeout: float = 30.0,
        verify: bool = True,
        on_transport_event: TransportEventHandler | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        parts = urlsplit(base_url or "")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise CoderAgentError("base_url must be an http(s) URL, e.g. https://coder.example.com")
        if parts.username or parts.password:
            raise CoderAgentError("base_url must not carry credentials")
        secret = token if isinstance(token, SecretStr) else SecretStr(token or "")
        if not secret.get_secret_value():
            raise CoderAgentError("a Coder session token is required")
        self._base_url = base_url.rstrip("/")
        self._token = secret
        self._organization_id = organization_id
        self._timeout = timeout
        self._verify = verify
        self._emitter = TransportEmitter(on_transport_event)
        self._ids = itertools.count(1)
        self._locked_prefix: str | None = None
        self._owns_http = http_client is None
        # The pool's transport, called directly when this client owns the pool and the
        # environment names no proxy (see _send_once); None: through the httpx client.
        self._direct: httpx.AsyncHTTPTransport | None = None
        if http_client is not None:
            self._http = http_client
        elif _environment_proxies():
            # httpx mounts the environment's proxies on a client it builds the
            # transport of: keep that client's routing.
            self._http = httpx.AsyncClient(
                timeout=timeout,
                verify=shared_ssl_context(verify),
                follow_redirects=False,
                headers={"User-Agent": _USER_AGENT},
            )
        else:
            # Every request goes to base_url (no redirects followed): an http:// client
            # never needs the CA bundle, and builds none.
            tls = shared_ssl_context(verify) if parts.scheme == "https" else _plain_http_context()
            self._direct = httpx.AsyncHTTPTransport(verify=tls)
            self._http = httpx.AsyncClient(
                transport=self._direct,
                timeout=timeout,
                follow_redirects=False,
                headers={"User-Agent": _USER_AGENT},
            )
        # What the httpx client would add to every request: its default headers
        # (Accept-Encoding, Connection, User-Agent; our Accept replaces its own) and
        # the pool timeouts.
        self._default_headers = {
            name: value for name, value in self._http.headers.items() if name != "accept"
        }
        self._timeouts = httpx.Timeout(timeout).as_dict()
        self._urls: dict[str, httpx.URL] = {}
        self._closed = False
        self._ws_proxies: dict[tuple[str, str], str | None] = {}

    # ------------------------------------------------------------------ basics

    @classmethod
    def from_settings(
        cls,
        settings: CoderSettings | None = None,
        *,
        on_transport_event: TransportEventHandler | None = None,
    ) -> ChatClient:
        """Build from ``CODER_*`` environment settings."""
        s = settings or CoderSettings()
        if not s.url or s.session_token is None:
            raise CoderAgentError("CODER_URL and CODER_SESSION_TOKEN must be set")
        return cls(
            s.url,
            s.session_token,
            organization_id=s.org_id,
            timeout=s.http_timeout,
            verify=s.verify_tls,
            on_transport_event=on_transport_event,
        )

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def organization_id(self) -> str | None:
        return self._organization_id

    @property
    def prefix(self) -> str:
        """The chat route prefix in use: the locked one, else v2."""
        return self._locked_prefix or V2_PREFIX

    @property
    def prefix_locked(self) -> bool:
        return self._locked_prefix is not None

    @property
    def verify(self) -> bool:
        return self._verify

    @property
    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of this client's REST pool and stream dials (shared per
        ``verify`` setting across the process; see :func:`shared_ssl_context`)."""
        return shared_ssl_context(self._verify)

    @property
    def emitter(self) -> TransportEmitter:
        """This client's transport-event emitter (the stream reader shares it)."""
        return self._emitter

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (
            f"ChatClient(base_url={self._base_url!r}, organization_id={self._organization_id!r}, "
            f"prefix={self.prefix!r}, prefix_locked={self.prefix_locked})"
        )

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError(
            "ChatClient holds a live connection pool and a secret; it cannot be pickled"
        )

    def ws_proxy(self, url: str) -> str | None:
        """The proxy for a WebSocket dial to ``url``, or None: websockets' own choice
        from the environment (``wss_proxy`` / ``https_proxy`` / ``socks_proxy`` …,
        ``no_proxy``), looked up once per scheme and host for this client — as its REST
        pool read the environment once, when it was built. Looked up on every dial, it
        walked the whole environment twice per turn (≈ 1.7 % of a fan-out worker's
        loop; docs/performance.md, round 9)."""
        parts = urlsplit(url)
        key = (parts.scheme, parts.netloc)
        if key not in self._ws_proxies:
            self._ws_proxies[key] = get_proxy(parse_uri(url))
        return self._ws_proxies[key]

    def auth_headers(self) -> dict[str, str]:
        """Headers for the WebSocket upgrade. Hand straight to the socket; never log."""
        return {TOKEN_HEADER: self._token.get_secret_value()}

    def stream_url(
        self, chat_id: str, after_id: int | None = None, *, history_version: int | None = None
    ) -> str:
        """``ws(s)://host{prefix}/{chat}/stream[?after_id=N][&<revision cursor>]``
        (never carries the token).

        ``history_version`` is a revision cursor the server itself reported (a
        ``status`` event's ``history_version``, which only B2 and later builds send).
        It goes out under both build names, ``after_revision=`` (B2) and
        ``history_version=`` (B3): each build reads its own and ignores the other's,
        and B1 (which never reports one) reads neither. ``after_id`` always goes too,
        so a build without a revision cursor still skips the caller's history.
        """
        scheme = "wss" if self._base_url.startswith("https://") else "ws"
        rest = self._base_url.split("://", 1)[1]
        url = f"{scheme}://{rest}{self.prefix}/{_seg(chat_id)}/stream"
        query: list[tuple[str, str]] = []
        if after_id is not None and after_id > 0:
            query.append(("after_id", str(int(after_id))))
        if history_version is not None and history_version > 0:
            # Zero is "no cursor" on every build (B3 reads 0 as "use after_id").
            rev = str(int(history_version))
            query += [("after_revision", rev), ("history_version", rev)]
        if query:
            url += "?" + urlencode(query)
        return url

    def stream_path(self, chat_id: str) -> str:
        return f"{self.prefix}/{_seg(chat_id)}/stream"

    def watch_url(self) -> str:
        """``ws(s)://host{prefix}/watch`` (lifecycle events of every visible chat)."""
        scheme = "wss" if self._base_url.startswith("https://") else "ws"
        return f"{scheme}://{self._base_url.split('://', 1)[1]}{self.prefix}/watch"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ core

    async def _send_once(
        self,
        op: str,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] | None,
        json_body: Any,
        content: bytes | None,
        headers: Mapping[str, str] | None,
    ) -> tuple[httpx.Response, bytes]:
        if self._closed:
            raise CoderAgentError("ChatClient is closed")
        request_id = next(self._ids)
        self._emitter.emit(lambda: HttpRequest(id=request_id, op=op, method=method, path=path))
        url = self._base_url + path
        if params:
            url += "?" + urlencode(list(params))
        target = self._urls.get(url)
        if target is None:
            # httpx parses and validates a URL string character by character (≈ a
            # tenth of a request's CPU); a chat's routes repeat (POST /chats, its
            # messages), so a parsed URL is kept per client, boundedly.
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            target = self._urls[url] = httpx.URL(url)
        direct = self._direct
        if direct is not None:
            request = httpx.Request(
                method,
                target,
                json=json_body if content is None else None,
                content=content,
                headers={
                    **self._default_headers,
                    "Accept": "application/json",
                    **(headers or {}),
                    **self.auth_headers(),
                },
                extensions={"timeout": self._timeouts},
            )
        else:
            request = self._http.build_request(
                method,
                target,
                json=json_body if content is None else None,
                content=content,
                headers={"Accept": "application/json", **(headers or {}), **self.auth_headers()},
            )
        started = time.perf_counter()
        failure: BaseException | None = None
        try:
            if direct is not None:
                # The pool's transport itself: what AsyncClient.send adds around it
                # (auth and redirect flows we do not use, a cookie jar we never read,
                # the URL and header merges) cost ≈ a fifth of a request's CPU.
                response = await direct.handle_async_request(request)
                response.request = request
            else:
                response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            failure = _transport_failure(method, url, exc, sent=False)
        except BaseException as exc:  # cancellation: report, then propagate unchanged
            message = type(exc).__name__
            self._emitter.emit(
                lambda: HttpError(
                    id=request_id,
                    op=op,
                    method=method,
                    path=path,
                    message=message,
                    duration_ms=_elapsed_ms(started),
                )
            )
            raise
        if failure is not None:
            message = str(failure) or type(failure).__name__
            self._emitter.emit(
                lambda: HttpError(
                    id=request_id,
                    op=op,
                    method=method,
                    path=path,
                    message=message,
                    duration_ms=_elapsed_ms(started),
                )
            )
            # Raised outside the except block so no __context__ links back to the
            # httpx exception (whose .request holds the auth header).
            raise failure
        status = response.status_code
        self._emitter.emit(
            lambda: HttpResponse(
                id=request_id,
                op=op,
                method=method,
                path=path,
                status=status,
                ok=200 <= status < 300,
                duration_ms=_elapsed_ms(started),
            )
        )
        body_failure: BaseException | None = None
        body = b""
        try:
            body = await response.aread()
        except httpx.TransportError as exc:
            # The server answered, so the request reached it.
            body_failure = _transport_failure(method, url, exc, sent=True)
        finally:
            await response.aclose()
        if body_failure is not None:
            raise body_failure
        return response, body

    async def _call(
        self,
        op: str,
        method: str,
        rel: str,
        *,
        chat_route: bool = True,
        params: Sequence[tuple[str, str]] | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        fallback_path: str | None = None,
    ) -> tuple[httpx.Response, bytes]:
        """Send with the prefix rules; return the 2xx response or raise CoderApiError.

        ``rel`` is relative to the chat prefix when ``chat_route`` (else absolute);
        ``fallback_path`` is an absolute path tried once on 404 for non-chat routes.
        """
        if timeout is not None:
            async with _deadline(timeout):
                return await self._call_inner(
                    op, method, rel, chat_route, params, json_body, content, headers, fallback_path
                )
        return await self._call_inner(
            op, method, rel, chat_route, params, json_body, content, headers, fallback_path
        )

    async def _call_inner(
        self,
        op: str,
        method: str,
        rel: str,
        chat_route: bool,
        params: Sequence[tuple[str, str]] | None,
        json_body: Any,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        fallback_path: str | None,
    ) -> tuple[httpx.Response, bytes]:
        def send(path: str) -> Any:
            return self._send_once(
                op,
                method,
                path,
                params=params,
                json_body=json_body,
                content=content,
                headers=headers,
            )

        if not chat_route:
            response, body = await send(rel)
            if response.status_code == 404 and fallback_path is not None:
                second, second_body = await send(fallback_path)
                if second.status_code != 404:
                    return _checked(method, fallback_path, second, second_body)
            return _checked(method, rel, response, body)

        if self._locked_prefix is not None:
            path = self._locked_prefix + rel
            response, body = await send(path)
            return _checked(method, path, response, body)

        v2_path = V2_PREFIX + rel
        response, body = await send(v2_path)
        if response.status_code != 404:
            self._lock(V2_PREFIX)
            return _checked(method, v2_path, response, body)
        exp_path = EXPERIMENTAL_PREFIX + rel
        second, second_body = await send(exp_path)
        if second.status_code != 404:
            self._lock(EXPERIMENTAL_PREFIX)
            return _checked(method, exp_path, second, second_body)
        # Both 404: a genuinely unknown resource (or no chat API at all). Keep the v2
        # error and stay unlocked; one 404 says nothing about which prefix is live.
        return _checked(method, v2_path, response, body)

    def _lock(self, prefix: str) -> None:
        if self._locked_prefix is None:
            self._locked_prefix = prefix

    async def ensure_prefix(self, *, op: str = "streamEvents", timeout: float | None = None) -> str:
        """WebSocket preflight: resolve the prefix with ``GET /api/v2/chats?limit=1``
        when it is not locked yet. HTTP errors only inform the lock and are not
        raised (the dial itself reports them); network errors and deadlines are.
        """
        if self._locked_prefix is None:
            try:
                await self._call(op, "GET", "", params=[("limit", "1")], timeout=timeout)
            except CoderApiError:
                pass
        return self.prefix

    def _org(self, organization_id: str | None) -> str:
        org = organization_id or self._organization_id
        if not org:
            raise CoderAgentError("organization_id is required (pass it or set CODER_ORG_ID)")
        return org

    # ------------------------------------------------------------------ chats

    async def create_chat(
        self, request: CreateChatRequest, *, timeout: float | None = None
    ) -> Chat:
        """``POST /chats`` → 201 Chat."""
        _, body = await self._call(
            "createChat", "POST", "", json_body=request.wire(), timeout=timeout
        )
        return Chat.model_validate_json(body)

    async def get_chat(self, chat_id: str, *, timeout: float | None = None) -> Chat:
        """``GET /chats/{id}``."""
        _, body = await self._call("getChat", "GET", f"/{_seg(chat_id)}", timeout=timeout)
        return Chat.model_validate_json(body)

    async def list_chats(
        self,
        *,
        q: str | None = None,
        labels: Mapping[str, str] | None = None,
        limit: int | None = None,
        offset: int | None = None,
        after_id: str | None = None,
        timeout: float | None = None,
    ) -> list[Chat]:
        """One page of ``GET /chats`` (root chats, children nested). ``labels`` are ANDed."""
        params: list[tuple[str, str]] = []
        if q:
            params.append(("q", q))
        for key, value in (labels or {}).items():
            params.append(("label", f"{key}:{value}"))
        if limit is not None:
            params.append(("limit", str(limit)))
        if offset is not None:
            params.append(("offset", str(offset)))
        if after_id is not None:
            params.append(("after_id", after_id))
        _, body = await self._call("listChats", "GET", "", params=params, timeout=timeout)
        data = _json(body)
        if not isinstance(data, list):
            raise CoderAgentError("GET /chats did not return a JSON array")
        return [Chat.model_validate(item) for item in data]

    async def iter_chats(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        archived: bool | None = False,
        page_size: int = 100,
        timeout: float | None = None,
    ) -> AsyncIterator[Chat]:
        """Every root chat matching ``labels``; ``archived=None`` walks both states.

        Pages by ``offset`` until a page is shorter than ``page_size``; a chat may be
        seen twice or missed if the listing changes between pages, so callers that
        sweep must be idempotent (reconcile by chat id). ``timeout`` bounds each page.
        """
        if page_size < 1:
            raise CoderAgentError("page_size must be >= 1")
        states = [False, True] if archived is None else [archived]
        for state in states:
            offset = 0
            while True:
                page = await self.list_chats(
                    q=f"archived:{'true' if state else 'false'}",
                    labels=labels,
                    limit=page_size,
                    offset=offset,
                    timeout=timeout,
                )
                for chat in page:
                    yield chat
                if len(page) < page_size:
                    break
                offset += len(page)

    async def update_chat(
        self, chat_id: str, request: UpdateChatRequest, *, timeout: float | None = None
    ) -> None:
        """``PATCH /chats/{id}`` → 204."""
        await self._call(
            "updateChat", "PATCH", f"/{_seg(chat_id)}", json_body=request.wire(), timeout=timeout
        )

    async def archive_chat(
        self, chat_id: str, *, archived: bool = True, timeout: float | None = None
    ) -> None:
        """``PATCH /chats/{id}`` with ``{"archived": archived}`` (op ``archiveChat``)."""
        await self._call(
            "archiveChat",
            "PATCH",
            f"/{_seg(chat_id)}",
            json_body={"archived": archived},
            timeout=timeout,
        )

    async def interrupt_chat(
        self, chat_id: str, *, wait: bool = False, timeout: float | None = None
    ) -> Chat:
        """``POST /chats/{id}/interrupt`` → post-transition Chat (409 when not interruptible)."""
        params = [("wait", "true")] if wait else None
        _, body = await self._call(
            "interruptChat", "POST", f"/{_seg(chat_id)}/interrupt", params=params, timeout=timeout
        )
        return Chat.model_validate_json(body)

    # ------------------------------------------------------------------ messages

    async def get_messages(
        self,
        chat_id: str,
        *,
        before_id: int | None = None,
        after_id: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> ChatMessagesResponse:
        """``GET /chats/{id}/messages``: newest first unless only ``after_id`` is given."""
        params: list[tuple[str, str]] = []
        if before_id is not None:
            params.append(("before_id", str(before_id)))
        if after_id is not None:
            params.append(("after_id", str(after_id)))
        if limit is not None:
            params.append(("limit", str(limit)))
        _, body = await self._call(
            "getMessages", "GET", f"/{_seg(chat_id)}/messages", params=params, timeout=timeout
        )
        return ChatMessagesResponse.model_validate_json(body)

    async def create_message(
        self,
        chat_id: str,
        request: CreateChatMessageRequest,
        *,
        timeout: float | None = None,
    ) -> CreateChatMessageResponse:
        """``POST /chats/{id}/messages`` → committed message or queued entry."""
        _, body = await self._call(
            "createChatMessage",
            "POST",
            f"/{_seg(chat_id)}/messages",
            json_body=request.wire(),
            timeout=timeout,
        )
        return CreateChatMessageResponse.model_validate_json(body)

    async def submit_tool_results(
        self, chat_id: str, results: Sequence[ToolResult], *, timeout: float | None = None
    ) -> None:
        """``POST /chats/{id}/tool-results`` → 204 (all pending calls in one request)."""
        await self._call(
            "submitToolResults",
            "POST",
            f"/{_seg(chat_id)}/tool-results",
            json_body={"results": [r.wire() for r in results]},
            timeout=timeout,
        )

    async def delete_queued_message(
        self, chat_id: str, queued_id: int, *, timeout: float | None = None
    ) -> None:
        """``DELETE /chats/{id}/queue/{queued_id}`` → 204."""
        await self._call(
            "deleteQueuedMessage",
            "DELETE",
            f"/{_seg(chat_id)}/queue/{_seg(queued_id)}",
            timeout=timeout,
        )

    async def promote_queued_message(
        self, chat_id: str, queued_id: int, *, timeout: float | None = None
    ) -> None:
        """``POST /chats/{id}/queue/{queued_id}/promote`` → 202 (legacy 200)."""
        await self._call(
            "promoteQueuedMessage",
            "POST",
            f"/{_seg(chat_id)}/queue/{_seg(queued_id)}/promote",
            timeout=timeout,
        )

    # ------------------------------------------------------------------ files & models

    async def upload_file(
        self,
        content: bytes,
        media_type: str,
        filename: str | None = None,
        *,
        organization_id: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """``POST /chats/files?organization=`` with the raw bytes → file id."""
        headers = {"Content-Type": media_type}
        if filename:
            safe = filename.replace("\\", "_").replace('"', "_").replace("\r", "").replace("\n", "")
            headers["Content-Disposition"] = f'attachment; filename="{safe}"'
        _, body = await self._call(
            "uploadChatFile",
            "POST",
            "/files",
            params=[("organization", self._org(organization_id))],
            content=bytes(content),
            headers=headers,
            timeout=timeout,
        )
        data = _json(body)
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise CoderAgentError("file upload response has no id")
        return str(data["id"])

    async def get_file(self, file_id: str, *, timeout: float | None = None) -> tuple[bytes, str]:
        """``GET /chats/files/{id}`` → (bytes, media type)."""
        response, body = await self._call(
            "getChatFile", "GET", f"/files/{_seg(file_id)}", timeout=timeout
        )
        media_type = response.headers.get("content-type", "application/octet-stream")
        return body, media_type.split(";", 1)[0].strip()

    async def list_models(
        self, *, organization_id: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """``GET /api/v2/organizations/{org}/chats/models`` → ``{models, providers, …}``.

        On 404 tries the legacy ``/api/experimental/chats/model-configs`` once (a
        bare list there is returned as ``{"models": [...]}``).
        """
        org = _seg(self._org(organization_id))
        _, body = await self._call(
            "listModelConfigs",
            "GET",
            f"/api/v2/organizations/{org}/chats/models",
            chat_route=False,
            fallback_path=f"{EXPERIMENTAL_PREFIX}/model-configs",
            timeout=timeout,
        )
        data = _json(body)
        if isinstance(data, list):
            return {"models": data}
        if not isinstance(data, dict):
            raise CoderAgentError("model listing did not return a JSON object")
        return data


# ---------------------------------------------------------------------- helpers


def _environment_proxies() -> bool:
    """Whether the environment names a proxy httpx would route a client through
    (``http_proxy`` / ``https_proxy`` / ``all_proxy``, any case; httpx reads them with
    the same ``urllib.request.getproxies``)."""
    return any(scheme in ("http", "https", "all") for scheme in getproxies())


def _elapsed_ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000.0, 3)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise CoderAgentError("response body is not JSON") from exc


def _checked(
    method: str, path: str, response: httpx.Response, body: bytes
) -> tuple[httpx.Response, bytes]:
    status = response.status_code
    if 200 <= status < 300:
        return response, body
    message, detail = _envelope(response, body)
    raise CoderApiError(status, method, path, message, detail)


def _envelope(response: httpx.Response, body: bytes) -> tuple[str, str | None]:
    """Coder error envelope ``{"message", "detail"?, "validations"?}`` → (message, detail)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("message"), str) and data["message"]:
        detail = data.get("detail") if isinstance(data.get("detail"), str) else None
        validations = data.get("validations")
        if not detail and isinstance(validations, list) and validations:
            detail = "; ".join(
                f"{v.get('field')}: {v.get('detail')}" for v in validations if isinstance(v, dict)
            )
        return data["message"], detail or None
    reason = response.reason_phrase or "request failed"
    return reason, None


#: httpx failures raised before any byte of the request left this process.
_NOT_SENT: Final = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_URL_HINT: Final = "Check CODER_URL (or the credentials block's base_url)"
_TLS_HINT: Final = (
    "Check the server's certificate, or CODER_VERIFY_TLS (the credentials block's verify_tls)"
)


def _transport_failure(
    method: str, url: str, exc: httpx.TransportError, *, sent: bool
) -> CoderTransportError:
    """A :class:`CoderTransportError` for an httpx failure, without the httpx object.

    The httpx exception keeps its ``.request`` (whose headers hold the token), so
    only its class name and message are copied. ``sent=False`` means the failure
    came from ``send`` (the class tells whether bytes left); ``True`` means a
    response had started.
    """
    reason = type(exc).__name__
    detail = str(exc) or None
    not_sent = not sent and isinstance(exc, _NOT_SENT)
    retry_safe = not_sent or method.upper() in IDEMPOTENT_METHODS
    hint: str | None = None
    if isinstance(exc, httpx.ConnectError):
        text = (detail or "").upper()
        hint = _TLS_HINT if "CERTIFICATE" in text or "SSL" in text else _URL_HINT
    elif isinstance(exc, httpx.ConnectTimeout):
        hint = _URL_HINT
    cls = CoderTimeoutError if isinstance(exc, httpx.TimeoutException) else CoderTransportError
    return cls(method, url, reason, retry_safe=retry_safe, detail=detail, hint=hint)


@contextlib.asynccontextmanager
async def _deadline(seconds: float) -> AsyncIterator[None]:
    """``asyncio.timeout`` whose expiry raises a ``TimeoutError`` naming the budget."""
    cm = asyncio.timeout(max(seconds, 0.0))
    try:
        async with cm:
            yield
    except TimeoutError:
        if cm.expired():
            raise TimeoutError(f"Coder API call exceeded its {seconds}s deadline") from None
        raise

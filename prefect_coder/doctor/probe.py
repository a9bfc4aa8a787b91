"""Thin I/O: one raw HTTP request to the Coder deployment, recorded as an ``Answer``.

For the read-only probes that the chat client deliberately hides (a route on one
exact prefix, ``buildinfo``, ``users/me``): the client's own TLS context
(``coder_chat.rest.shared_ssl_context``), no redirects (the token header never goes
to another host), the token only in the ``Coder-Session-Token`` header. An httpx
exception is never kept (its request holds the header): only its class, its text
and what the failure was.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator, Sequence

import httpx
from pydantic import SecretStr

from coder_chat.rest import TOKEN_HEADER, shared_ssl_context

from .observed import Answer, Failure

__all__ = ["Prober", "classify"]

_DNS_TEXT = (
    "name or service not known",
    "nodename nor servname",
    "getaddrinfo failed",
    "temporary failure in name resolution",
    "no address associated",
    "name resolution",
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def classify(exc: BaseException) -> tuple[Failure, str]:
    """What kind of network failure ``exc`` is, and a one-line text of it."""
    for e in _chain(exc):
        if isinstance(e, ssl.SSLCertVerificationError):
            return Failure.TLS, e.verify_message or str(e)
        if isinstance(e, ssl.SSLError):
            return Failure.TLS, str(e)
        if isinstance(e, socket.gaierror):
            return Failure.DNS, str(e)
        if isinstance(e, ConnectionRefusedError):
            return Failure.REFUSED, str(e)
    text = str(exc) or type(exc).__name__
    return classify_text(
        text, timeout=isinstance(exc, (httpx.TimeoutException, TimeoutError))
    ), text


def classify_text(text: str, *, timeout: bool = False) -> Failure:
    """The failure kind from an error's text alone (the client's errors keep no cause)."""
    low = text.lower()
    if "certificate" in low or "ssl" in low or "tls" in low:
        return Failure.TLS
    if "refused" in low or "errno 111" in low:
        return Failure.REFUSED
    if any(t in low for t in _DNS_TEXT):
        return Failure.DNS
    if timeout or "timed out" in low or "timeout" in low:
        return Failure.TIMEOUT
    return Failure.NETWORK


class Prober:
    """Raw requests to one deployment. ``async with Prober(...) as p: await p.get(...)``."""

    def __init__(self, base_url: str, token: SecretStr, *, verify: bool, timeout: float) -> None:
        self._base = base_url.rstrip("/")
        self._token = token
        tls = shared_ssl_context(verify)
        self._http = httpx.AsyncClient(
            verify=tls, timeout=timeout, follow_redirects=False, trust_env=True
        )

    async def __aenter__(self) -> Prober:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] = (),
        auth: bool = True,
    ) -> Answer:
        """``method path`` → its Answer (never raises for a network failure)."""
        headers = {"Accept": "application/json"}
        if auth:
            headers[TOKEN_HEADER] = self._token.get_secret_value()
        started = time.perf_counter()
        shown = path + ("?" + "&".join(f"{k}={v}" for k, v in params) if params else "")
        failure: tuple[Failure, str] | None = None
        try:
            response = await self._http.request(
                method, self._base + path, params=list(params), headers=headers
            )
        except httpx.HTTPError as exc:
            failure = classify(exc)
        elapsed = (time.perf_counter() - started) * 1000.0
        if failure is not None:
            # Built outside the except block: no traceback links back to the request.
            return Answer(method, shown, failure=failure[0], detail=failure[1], elapsed_ms=elapsed)
        try:
            body = response.json()
        except ValueError:
            body = None
        message, detail = "", ""
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            message = body["message"]
            detail = body["detail"] if isinstance(body.get("detail"), str) else ""
        elif not 200 <= response.status_code < 300:
            message = response.reason_phrase
        return Answer(
            method,
            shown,
            status=response.status_code,
            message=message,
            detail=detail or "",
            body=body,
            elapsed_ms=elapsed,
        )

    async def get(
        self, path: str, *, params: Sequence[tuple[str, str]] = (), auth: bool = True
    ) -> Answer:
        """``GET path``."""
        return await self.request("GET", path, params=params, auth=auth)

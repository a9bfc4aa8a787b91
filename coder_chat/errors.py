"""Error types of the chatd client (agent-semantics spec §7).

Every error the client raises derives from :class:`CoderError`, so one
``except CoderError`` catches them all. Aside: expired budgets stay the builtin
``TimeoutError`` (the caller's own deadline, a per-call ``timeout=``, a settle
budget), cancellation stays ``CancelledError``, and argument mistakes stay
``TypeError``/``ValueError``::

    CoderError(Exception)                   root of everything below; retryable=False
    ├─ CoderAgentError                      misuse, bad construction, unparseable frame
    │  ├─ CoderApiError                     non-2xx REST response / non-transient 4xx WS upgrade;
    │  │                                    retryable for 408/425/429/5xx
    │  ├─ CoderChatError                    server ``error`` event (retryable: the server's),
    │  │  │                                 timeout, stream_closed, archive_incomplete
    │  │  │                                 (retryable), queued_submission_lost (not)
    │  │  └─ ToolBookkeepingError           a crash-safe tool's ledger write failed: the
    │  │                                    turn fails (retryable), the pause stays open
    │  ├─ GatewayError, GatewayOutputError  AI Gateway calls (``coder_chat.gateway``);
    │  │                                    retryable for rate limits and 5xx
    │  └─ NoTurnToFollowError               ``follow()`` found no turn (``coder_chat.agent``)
    ├─ CoderStreamError                     redial budget exhausted / undedupable drop
    │                                       (deliberately NOT a CoderAgentError, spec §7);
    │                                       retryable (alias is_retryable) per the agent
    ├─ CoderRecoveryError                   crash recovery cannot finish (no re-drive path,
    │                                       the chat keeps pausing); also a RuntimeError
    └─ CoderTransportError                  the HTTP request failed on the network:
       │                                    refused, reset, DNS, TLS, protocol error;
       │                                    retryable=True, retry_safe per request
       └─ CoderTimeoutError                 httpx connect/read/write/pool timeout
                                            (also a builtin ``TimeoutError``)

Retryability has one spelling, ``retryable`` (every error has it, default
``False``): the client's verdict that the same operation, tried again, may
succeed — the failure was transient. A server error the server marked
retryable, our own ``request_timeout``, a stream that closed early, an archive
window too short, a 408/425/429/5xx answer and a network failure are. A stream
failure is only on a fresh chat with no workspace or MCP servers (the agent's
verdict, spec §7): on any other chat the retry decision is the caller's.
``retryable`` never says a blind re-send is free: a resubmitted prompt is a new
turn, and a run that may have landed should be settled first (docs/client.md
says what to do per error). ``CoderStreamError.is_retryable`` is the same value
under the spec's §7 name.

A transport error names the method and URL (never a header, so never the
token), the httpx failure (``reason``) and whether sending the same request
again is safe (``retry_safe``, a different question from ``retryable``): true
for idempotent methods and for failures before any byte left (connect errors,
connect/pool timeouts); false for a POST or PATCH whose request may have
reached the server. A refused connection or a TLS failure says which setting
to check.

The per-call ``timeout=`` deadline of :class:`~coder_chat.rest.ChatClient` is
the caller's budget, not a network failure: it stays a builtin ``TimeoutError``.

No message, ``repr`` or attribute of these errors ever contains the session
token: they are built only from status codes, request paths and URLs (which
never carry the token), server-provided messages and our own text.

All classes pickle round-trip (Prefect may persist a failed task's exception),
which the default ``Exception`` pickling would break for keyword-only fields.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CoderAgentError",
    "CoderApiError",
    "CoderChatError",
    "CoderError",
    "CoderRecoveryError",
    "CoderStreamError",
    "CoderTimeoutError",
    "CoderTransportError",
    "ToolBookkeepingError",
    "is_transient",
]

#: HTTP methods whose repetition has no extra effect (RFC 9110 §9.2.2).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


class CoderError(Exception):
    """Root of every error the chatd client raises.

    ``retryable``: whether the failure is transient (the same operation, tried
    again, may succeed). ``False`` unless a subclass or the raiser says so.
    """

    retryable: bool = False


class CoderAgentError(CoderError):
    """Misuse, bad construction, bad cursor, bad frame; base of API and chat errors."""


class CoderApiError(CoderAgentError):
    """A non-2xx REST response, or a non-transient 4xx WebSocket upgrade rejection.

    Message: ``Coder API <METHOD> <path> failed (<status>): <message>[ — <detail>]``.
    ``message``/``detail`` come from the Coder error envelope
    ``{"message": ..., "detail": ...}``; when the body is not an envelope the
    message is the HTTP reason phrase (or a short body excerpt).

    ``retryable`` is true for 408, 425, 429 and 5xx (a retry may get past them);
    401/403/404 and other 4xx hit the same wall every time.
    """

    def __init__(
        self,
        status: int,
        method: str,
        path: str,
        message: str,
        detail: str | None = None,
    ) -> None:
        self.status = status
        self.method = method
        self.path = path
        self.message = message
        self.detail = detail
        self.retryable = status in (408, 425, 429) or status >= 500
        text = f"Coder API {method} {path} failed ({status}): {message}"
        if detail:
            text += f" — {detail}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.method, self.path, self.message, self.detail))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status!r}, method={self.method!r}, "
            f"path={self.path!r}, message={self.message!r}, detail={self.detail!r})"
        )


class CoderChatError(CoderAgentError):
    """The chat turn failed: a server ``error`` event, our own timeout, a stream that
    closed before the turn settled, or a lost queued submission.

    Message: ``<message>[: <detail>]``. ``kind`` is the server's error kind
    (``generic``, ``overloaded``, ``rate_limit``…) or one of the client kinds
    ``timeout`` (retryable), ``stream_closed`` (retryable) and
    ``queued_submission_lost`` (not retryable).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        retryable: bool = False,
        status_code: int | None = None,
        provider: str | None = None,
        detail: str | None = None,
    ) -> None:
        self.message = message
        self.kind = kind
        self.retryable = retryable
        self.status_code = status_code
        self.provider = provider
        self.detail = detail
        super().__init__(f"{message}: {detail}" if detail else message)

    @classmethod
    def from_payload(cls, payload: Any) -> CoderChatError:
        """Build from a wire ``ChatError`` (a ``models.ChatError`` or its dict form)."""
        data: dict[str, Any]
        if hasattr(payload, "model_dump"):
            data = payload.model_dump()
        elif isinstance(payload, dict):
            data = payload
        else:
            data = {}
        message = data.get("message")
        status_code = data.get("status_code")
        return cls(
            message if isinstance(message, str) and message else "The chat request failed.",
            kind=data.get("kind") if isinstance(data.get("kind"), str) else None,
            retryable=data.get("retryable") is True,
            status_code=status_code if isinstance(status_code, int) else None,
            provider=data.get("provider") if isinstance(data.get("provider"), str) else None,
            detail=data.get("detail") if isinstance(data.get("detail"), str) else None,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_chat_error,
            (
                type(self),
                self.message,
                self.kind,
                self.retryable,
                self.status_code,
                self.provider,
                self.detail,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, kind={self.kind!r}, "
            f"retryable={self.retryable!r}, status_code={self.status_code!r}, "
            f"provider={self.provider!r}, detail={self.detail!r})"
        )


def _rebuild_chat_error(
    cls: type[CoderChatError],
    message: str,
    kind: str | None,
    retryable: bool,
    status_code: int | None,
    provider: str | None,
    detail: str | None,
) -> CoderChatError:
    return cls(
        message,
        kind=kind,
        retryable=retryable,
        status_code=status_code,
        provider=provider,
        detail=detail,
    )


class ToolBookkeepingError(CoderChatError):
    """A crash-safe tool's bookkeeping failed around its effect: the ledger's
    write-ahead (``stage="begin"``), the ``done`` write after the effect
    (``stage="complete"``), or the tool's ``before_effect`` hook.

    The tool's outcome is then NOT reported to the model (a "tool failed" answer
    would be a lie when the effect ran, and the model would call the tool again
    under a new call id — a new idempotency key). The turn fails instead, with
    the ``requires_action`` pause unanswered, and the next attempt's recovery
    reconciles the call from the ledger under the SAME key. ``retryable`` is
    True (``kind="tool_bookkeeping"``).

    The message names the tool, the call and the stage, never the store's
    exception (SQL, hosts, file paths): that is chained as ``__cause__`` for the
    run's log and traceback.
    """

    #: ``ClientTool.run`` lets an exception with a true ``fails_turn`` through
    #: instead of turning it into an ``is_error`` result (``coder_chat.tools``).
    fails_turn = True

    def __init__(self, tool_name: str, tool_call_id: str, stage: str) -> None:
        self.tool_name = tool_name
        self.tool_call_id = tool_call_id
        self.stage = stage
        super().__init__(
            f"the ledger bookkeeping of client tool {tool_name!r} (call {tool_call_id}) "
            f"failed at {stage!r}: the turn fails with the call unanswered, for recovery "
            "to finish under the same idempotency key",
            kind="tool_bookkeeping",
            retryable=True,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tool_name, self.tool_call_id, self.stage))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tool_name={self.tool_name!r}, "
            f"tool_call_id={self.tool_call_id!r}, stage={self.stage!r})"
        )


class CoderStreamError(CoderError):
    """The chat stream could not be kept alive: the redial budget was exhausted
    (5 consecutive connection endings; progress restarts the count) or a drop happened while
    coordinate-less deltas were outstanding (replay could duplicate content).

    Deliberately not a ``CoderAgentError`` (the TypeScript SDK raises an AI SDK
    ``APICallError``). ``retryable`` is decided by the agent (a fresh chat
    with no workspace/MCP/uploads may be retried); the stream layer raises it
    with ``retryable=False`` and the agent re-raises via :meth:`with_retry`.
    ``is_retryable`` is the same value under the spec's §7 name (an alias,
    also accepted by the constructor). ``url`` is the stream URL (no token);
    ``cause`` the last transport failure.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        chat_id: str | None = None,
        cause: BaseException | None = None,
        retryable: bool = False,
        is_retryable: bool | None = None,
    ) -> None:
        if is_retryable is not None:
            if retryable and not is_retryable:
                raise TypeError("retryable and is_retryable disagree: pass one")
            retryable = is_retryable
        self.message = message
        self.url = url
        self.chat_id = chat_id
        self.cause = cause
        self.retryable = retryable
        super().__init__(message)
        if cause is not None:
            self.__cause__ = cause

    @property
    def is_retryable(self) -> bool:
        """``retryable`` under the spec's name (agent-semantics §7, ``isRetryable``)."""
        return self.retryable

    def with_retry(self, retryable: bool, reason: str | None = None) -> CoderStreamError:
        """A copy with ``retryable`` decided; ``reason`` is appended to the message."""
        message = f"{self.message} ({reason})" if reason else self.message
        return CoderStreamError(
            message,
            url=self.url,
            chat_id=self.chat_id,
            cause=self.cause,
            retryable=retryable,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # The cause may not pickle (sockets, locks); keep only its text then.
        cause: BaseException | None = self.cause
        if cause is not None:
            import pickle

            try:
                pickle.dumps(cause)
            except Exception:
                cause = RuntimeError(f"{type(cause).__name__}: {cause}")
        return (
            _rebuild_stream_error,
            (type(self), self.message, self.url, self.chat_id, cause, self.retryable),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, url={self.url!r}, "
            f"chat_id={self.chat_id!r}, retryable={self.retryable!r}, "
            f"cause={self.cause!r})"
        )


def _rebuild_stream_error(
    cls: type[CoderStreamError],
    message: str,
    url: str,
    chat_id: str | None,
    cause: BaseException | None,
    retryable: bool,
) -> CoderStreamError:
    return cls(message, url=url, chat_id=chat_id, cause=cause, retryable=retryable)


class CoderRecoveryError(CoderError, RuntimeError):
    """Crash recovery (``coder_chat.recovery``) cannot bring the step to an answer:
    a committing tool has no re-drive path, or the chat keeps pausing on client
    tools round after round. Also a ``RuntimeError``, as it was before the root."""


class CoderTransportError(CoderError):
    """An HTTP request to chatd failed on the network (no HTTP response).

    ``method`` and ``url`` name the request (the URL never carries the token);
    ``reason`` is the httpx failure class (``ConnectError``, ``ReadError``…);
    ``hint`` names the setting to check, if any.

    Two different questions: ``retryable`` (always true here, as for every
    error) says the failure is transient — the network may work next time;
    ``retry_safe`` says whether sending *this same request* again cannot apply
    it twice: true for idempotent methods and for failures before the request
    was sent; false for a POST/PATCH that may have reached the server (check
    the chat before re-sending: the prompt or tool results may have landed).
    """

    retryable = True

    def __init__(
        self,
        method: str,
        url: str,
        reason: str,
        *,
        retry_safe: bool,
        detail: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.method = method
        self.url = url
        self.reason = reason
        self.retry_safe = retry_safe
        self.detail = detail
        self.hint = hint
        text = f"Coder API {method} {url} failed: {reason}"
        if detail:
            text += f" ({detail})"
        text += "; safe to retry" if retry_safe else "; the request may have reached the server"
        if hint:
            text += f". {hint}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_transport_error,
            (
                type(self),
                self.method,
                self.url,
                self.reason,
                self.retry_safe,
                self.detail,
                self.hint,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(method={self.method!r}, url={self.url!r}, "
            f"reason={self.reason!r}, retry_safe={self.retry_safe!r}, detail={self.detail!r})"
        )


class CoderTimeoutError(CoderTransportError, TimeoutError):
    """httpx gave up waiting on the network (connect, read, write or pool timeout).

    Also a builtin ``TimeoutError``, as these were before the error root existed.
    """


def _rebuild_transport_error(
    cls: type[CoderTransportError],
    method: str,
    url: str,
    reason: str,
    retry_safe: bool,
    detail: str | None,
    hint: str | None,
) -> CoderTransportError:
    return cls(method, url, reason, retry_safe=retry_safe, detail=detail, hint=hint)


def is_transient(failure: BaseException | None) -> bool:
    """A *request* failure after which what it asked for may well have happened: no
    HTTP response (the request may have landed) or a status a retry may get past
    (408, 425, 429, 5xx) — a ``retryable`` transport or API error. The agent then
    leaves a landed run alone and recovery reads history before sending the same
    request again."""
    return isinstance(failure, CoderTransportError | CoderApiError) and failure.retryable

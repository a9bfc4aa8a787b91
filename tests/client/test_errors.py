"""Error classes: hierarchy, fields, messages, pickling (agent-semantics §7)."""

from __future__ import annotations

import pickle

from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderChatError,
    CoderError,
    CoderRecoveryError,
    CoderStreamError,
    CoderTimeoutError,
    CoderTransportError,
)
from coder_chat.models import ChatError


def test_hierarchy() -> None:
    assert issubclass(CoderApiError, CoderAgentError)
    assert issubclass(CoderChatError, CoderAgentError)
    assert not issubclass(CoderStreamError, CoderAgentError)
    for cls in (
        CoderAgentError,
        CoderApiError,
        CoderChatError,
        CoderStreamError,
        CoderTransportError,
        CoderTimeoutError,
        CoderRecoveryError,
    ):
        assert issubclass(cls, CoderError)
    assert not issubclass(CoderTransportError, CoderAgentError)
    assert issubclass(CoderTimeoutError, CoderTransportError)
    assert issubclass(CoderTimeoutError, TimeoutError)  # as before the root existed
    assert issubclass(CoderRecoveryError, RuntimeError)  # likewise


def test_transport_error_fields_and_pickling() -> None:
    err = CoderTimeoutError(
        "POST",
        "http://h/api/v2/chats/c/messages",
        "ReadTimeout",
        retry_safe=False,
        detail="timed out",
    )
    assert str(err) == (
        "Coder API POST http://h/api/v2/chats/c/messages failed: ReadTimeout (timed out); "
        "the request may have reached the server"
    )
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CoderTimeoutError and str(again) == str(err)
    assert (again.method, again.url, again.reason, again.retry_safe) == (
        "POST",
        "http://h/api/v2/chats/c/messages",
        "ReadTimeout",
        False,
    )
    refused = CoderTransportError(
        "GET", "http://h/api/v2/chats", "ConnectError", retry_safe=True, hint="Check CODER_URL"
    )
    assert str(refused).endswith("; safe to retry. Check CODER_URL")
    assert pickle.loads(pickle.dumps(refused)).hint == "Check CODER_URL"


def test_api_error_message_and_fields() -> None:
    err = CoderApiError(
        400, "POST", "/api/v2/chats/x/messages", "Cannot send messages to an archived chat."
    )
    assert str(err) == (
        "Coder API POST /api/v2/chats/x/messages failed (400): "
        "Cannot send messages to an archived chat."
    )
    assert (err.status, err.method, err.path, err.detail) == (
        400,
        "POST",
        "/api/v2/chats/x/messages",
        None,
    )
    with_detail = CoderApiError(
        429, "POST", "/p", "Message queue is full.", "Maximum 20 messages can be queued."
    )
    assert str(with_detail).endswith("Message queue is full. — Maximum 20 messages can be queued.")
    again = pickle.loads(pickle.dumps(with_detail))
    assert isinstance(again, CoderApiError)
    assert (again.status, again.detail, str(again)) == (429, with_detail.detail, str(with_detail))


def test_chat_error_from_payload() -> None:
    payload = ChatError.model_validate(
        {
            "message": "upstream overloaded",
            "detail": "503 from provider",
            "kind": "overloaded",
            "provider": "anthropic",
            "retryable": True,
            "status_code": 503,
            "future_field": 1,
        }
    )
    err = CoderChatError.from_payload(payload)
    assert str(err) == "upstream overloaded: 503 from provider"
    assert (err.kind, err.retryable, err.status_code, err.provider) == (
        "overloaded",
        True,
        503,
        "anthropic",
    )
    again = pickle.loads(pickle.dumps(err))
    assert (again.kind, again.retryable, again.status_code, str(again)) == (
        "overloaded",
        True,
        503,
        str(err),
    )
    # defaults: not retryable unless said so
    plain = CoderChatError(
        "stream ended before the turn settled", kind="stream_closed", retryable=True
    )
    assert str(plain) == "stream ended before the turn settled"
    assert CoderChatError.from_payload({"message": "x"}).retryable is False


def test_stream_error_fields_and_retry_copy() -> None:
    cause = ConnectionResetError("reset by peer")
    err = CoderStreamError(
        "could not be re-established", url="ws://h/api/v2/chats/c/stream", chat_id="c", cause=cause
    )
    assert err.is_retryable is False and err.__cause__ is cause
    retry = err.with_retry(False, "the chat has a workspace")
    assert str(retry) == "could not be re-established (the chat has a workspace)"
    assert retry.chat_id == "c" and retry.url == err.url and retry.cause is cause
    again = pickle.loads(pickle.dumps(err.with_retry(True)))
    assert again.is_retryable is True and again.chat_id == "c"
    assert isinstance(again.cause, ConnectionResetError)


def test_retryable_is_the_one_spelling() -> None:
    """Every error answers ``retryable``; ``is_retryable`` (spec §7) is its alias on
    the stream error, and ``retry_safe`` is a different question (re-sending the
    same request cannot apply it twice)."""
    assert CoderError("x").retryable is False
    assert CoderAgentError("misuse").retryable is False
    assert CoderRecoveryError("stuck").retryable is False
    # a status a retry may get past, and the ones that hit the same wall again
    for status in (408, 425, 429, 500, 502, 503):
        assert CoderApiError(status, "POST", "/p", "m").retryable, status
    for status in (400, 401, 403, 404, 409, 422):
        assert not CoderApiError(status, "POST", "/p", "m").retryable, status
    assert pickle.loads(pickle.dumps(CoderApiError(503, "GET", "/p", "m"))).retryable
    # a network failure is transient even when re-sending the request is not safe
    lost = CoderTransportError("POST", "http://h/p", "ReadError", retry_safe=False)
    assert lost.retryable and not lost.retry_safe
    assert CoderTimeoutError("GET", "http://h/p", "ConnectTimeout", retry_safe=True).retryable
    # the stream error: one value, two names; both constructor spellings agree
    fresh = CoderStreamError("s", url="ws://x", retryable=True)
    spec = CoderStreamError("s", url="ws://x", is_retryable=True)
    assert fresh.retryable and fresh.is_retryable and spec.retryable and spec.is_retryable
    resumed = CoderStreamError("s", url="ws://x").with_retry(False, "the chat existed")
    assert resumed.retryable is False and resumed.is_retryable is False
    assert "retryable=False" in repr(resumed)
    assert pickle.loads(pickle.dumps(fresh)).retryable is True

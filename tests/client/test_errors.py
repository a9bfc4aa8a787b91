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

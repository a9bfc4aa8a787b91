"""Issue 30: an archive cannot be undone, so the failure handler archives only on a
POSITIVE verdict — failures known to be final for the workflow (an allow-list).
Everything else, the store's and the Prefect API's faults above all, keeps the chat
live (``coder.workflow.resumable``). The verdict is a pure function: a table."""

from __future__ import annotations

import sqlite3

import asyncpg
import httpx
import pytest
import sqlalchemy as sa
from prefect.exceptions import FailedRun

from coder_chat.errors import (
    CoderApiError,
    CoderChatError,
    CoderRecoveryError,
    CoderTimeoutError,
    CoderTransportError,
    ToolBookkeepingError,
)
from prefect_coder.blocks.state import LeaseLostError, LeaseUnavailableError
from prefect_coder.blocks.state.errors import StateStoreConfigError, StoreUnavailableError
from prefect_coder.flows.common.errors import (
    StructuredAnswerError,
    WorkflowBusyError,
    WorkflowParameterError,
)
from prefect_coder.flows.common.retry import is_retryable_failure
from prefect_coder.flows.workflow.end_of_life import APPROVAL_EXPIRED_MESSAGE, archive_verdict

URL = "postgresql+asyncpg://coder@db:5432/state"


def _locked() -> sa.exc.OperationalError:
    return sa.exc.OperationalError(
        "BEGIN IMMEDIATE", None, sqlite3.OperationalError("database is locked")
    )


def _closed() -> sa.exc.InterfaceError:
    err = sa.exc.InterfaceError(
        "INSERT INTO coder_state_checkpoints ...",
        None,
        asyncpg.exceptions.InterfaceError("cannot call Connection.fetch(): connection is closed"),
    )
    return err


def _http_503() -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://prefect.internal/api/task_runs/")
    return httpx.HTTPStatusError(
        "503 Service Unavailable", request=request, response=httpx.Response(503, request=request)
    )


def _wrapped_lease_loss() -> BaseException:
    """What the flow sees when the fence refuses a crash-safe tool's ledger write."""
    try:
        try:
            raise LeaseLostError("workflow:wf", "h")
        except LeaseLostError as lost:
            raise ToolBookkeepingError("charge_card", "call-1", "complete") from lost
    except ToolBookkeepingError as exc:
        return exc


CASES: list[tuple[str, BaseException | None, str]] = [
    # Final for the workflow: archive.
    ("structured answer never validated", StructuredAnswerError("s", "M", "chat-1", 2), "archive"),
    ("the turn's total deadline", TimeoutError(), "archive"),
    ("an approval expired", FailedRun(APPROVAL_EXPIRED_MESSAGE), "archive"),
    ("the server failed the chat's run", CoderChatError("model failed", kind="generic"), "archive"),
    # Not this run's chat: leave it alone, say nothing.
    (
        "bad parameters, before any send",
        WorkflowParameterError("steps", "empty", "pass one"),
        "leave",
    ),
    ("another run holds the workflow", WorkflowBusyError("wf", 3.0), "leave"),
    ("lost the lease to a takeover", LeaseLostError("workflow:wf", "h"), "leave"),
    ("a tool's ledger write refused by the fence", _wrapped_lease_loss(), "leave"),
    # The store: transient, after its own retries.
    ("store unavailable", StoreUnavailableError(URL, "ConnectionRefusedError"), "keep-live"),
    ("raw SQLite lock timeout", _locked(), "keep-live"),
    ("raw closed PostgreSQL connection", _closed(), "keep-live"),
    ("PostgreSQL serialization failure", asyncpg.exceptions.SerializationError("x"), "keep-live"),
    # The store, permanent: still not known final for the WORKFLOW (fix, rerun).
    ("store misconfigured", StateStoreConfigError("url: bad"), "keep-live"),
    (
        "schema bug",
        sa.exc.ProgrammingError("SELECT", None, Exception("no such table")),
        "keep-live",
    ),
    # The network, the Prefect API, the server's 5xx, the client's own kinds.
    ("Prefect API 503", _http_503(), "keep-live"),
    ("bare connection refused", ConnectionRefusedError(111, "refused"), "keep-live"),
    ("Coder 503", CoderApiError(503, "POST", "/chats/x/messages", "unavailable"), "keep-live"),
    ("Coder 401", CoderApiError(401, "GET", "/chats/x", "unauthorized"), "keep-live"),
    (
        "Coder 400 archived chat",
        CoderApiError(400, "POST", "/chats/x/messages", "archived"),
        "keep-live",
    ),
    (
        "httpx timeout",
        CoderTimeoutError("GET", "http://c/chats", "read timeout", retry_safe=True),
        "keep-live",
    ),
    (
        "transport reset",
        CoderTransportError("POST", "http://c", "reset", retry_safe=False),
        "keep-live",
    ),
    ("stream closed", CoderChatError("closed", kind="stream_closed", retryable=True), "keep-live"),
    ("queued submission lost", CoderChatError("lost", kind="queued_submission_lost"), "keep-live"),
    ("ledger write failed", CoderChatError("bookkeeping", kind="tool_bookkeeping"), "keep-live"),
    ("recovery needs a person", CoderRecoveryError("decide by hand"), "keep-live"),
    (
        "lease wait ran out",
        LeaseUnavailableError("k", holder="h", expires_in=1.0, waited=2.0),
        "keep-live",
    ),
    ("a bug", KeyError("x"), "keep-live"),
    ("a run failed without an exception", FailedRun("Flow run was crashed"), "keep-live"),
    ("unreadable failure", None, "keep-live"),
]


@pytest.mark.parametrize(("case", "failure", "action"), CASES, ids=[c[0] for c in CASES])
def test_archive_verdict(case: str, failure: BaseException | None, action: str) -> None:
    verdict = archive_verdict(failure)
    assert verdict.action == action, (case, verdict)
    assert verdict.why


def test_only_the_allow_list_archives() -> None:
    archiving = [c for c, f, _ in CASES if archive_verdict(f).action == "archive"]
    assert archiving == [
        "structured answer never validated",
        "the turn's total deadline",
        "an approval expired",
        "the server failed the chat's run",
    ]


def test_expire_approvals_fails_runs_with_the_message_the_verdict_archives() -> None:
    from prefect_coder.flows.deployments.expire_approvals import EXPIRED_MESSAGE

    assert EXPIRED_MESSAGE == APPROVAL_EXPIRED_MESSAGE


RETRY_CASES: list[tuple[str, BaseException, bool]] = [
    ("store unavailable", StoreUnavailableError(URL, "ConnectionRefusedError"), True),
    ("raw SQLite lock timeout", _locked(), True),
    ("raw closed PostgreSQL connection", _closed(), True),
    ("schema bug", sa.exc.ProgrammingError("SELECT", None, Exception("no such table")), False),
    ("store misconfigured", StateStoreConfigError("url: bad"), False),
    ("Prefect API 503", _http_503(), True),
    ("Prefect API unreachable", httpx.ConnectError("refused"), True),
    ("the turn's total deadline", TimeoutError(), False),
    ("bare connection refused", ConnectionRefusedError(111, "refused"), False),
]


@pytest.mark.parametrize(("case", "failure", "retry"), RETRY_CASES, ids=[c[0] for c in RETRY_CASES])
def test_task_retries_follow_the_one_fault_model(
    case: str, failure: BaseException, retry: bool
) -> None:
    assert is_retryable_failure(failure) is retry, case

"""What the doctor observed: plain records the observers fill and the verdicts read.

Pure data, no I/O. Nothing here ever holds a token or a password: an observer records
statuses, messages and error texts, never a request's headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "Answer",
    "CoderObserved",
    "Failure",
    "PrefectObserved",
    "RoutesObserved",
    "SmokeObserved",
    "StoreObserved",
]


class Failure(StrEnum):
    """Why a request got no HTTP answer."""

    REFUSED = "connection refused"
    DNS = "name not resolved"
    TLS = "TLS failure"
    TIMEOUT = "timeout"
    NETWORK = "network error"


@dataclass(frozen=True, slots=True)
class Answer:
    """What one request got: an HTTP ``status`` with the Coder envelope's ``message``
    (and ``detail``), or a ``failure`` and its text. ``status`` 101 is an accepted
    WebSocket upgrade."""

    method: str
    path: str
    status: int | None = None
    message: str = ""
    detail: str = ""
    body: Any = None
    failure: Failure | None = None
    elapsed_ms: float = 0.0

    @property
    def ok(self) -> bool:
        """A 2xx answer (or 101 for a WebSocket dial)."""
        return self.status is not None and (200 <= self.status < 300 or self.status == 101)

    @property
    def server_error(self) -> bool:
        """A 5xx answer."""
        return self.status is not None and self.status >= 500

    def describe(self) -> str:
        """``GET /path → 404 Route not found.`` or ``GET /path → connection refused (…)``."""
        head = f"{self.method} {self.path} → "
        if self.status is None:
            what = self.failure.value if self.failure else "no answer"
            return head + what + (f" ({self.detail})" if self.detail else "")
        text = f"{head}{self.status}"
        if self.message:
            text += f" {self.message}"
        if self.detail:
            text += f" ({self.detail})"
        return text


@dataclass(frozen=True, slots=True)
class CoderObserved:
    """The read-only probes of a Coder deployment, in the order they ran (a probe is
    None when an earlier one made it pointless)."""

    base_url: str
    verify_tls: bool
    server: Answer  # GET /api/v2/buildinfo, sent without the token
    me: Answer | None = None  # GET /api/v2/users/me
    organization_id: str | None = None
    organization_invalid: bool = False
    models: Answer | None = None  # GET /api/v2/organizations/{org}/chats/models
    v2_list: Answer | None = None  # GET /api/v2/chats?limit=1
    experimental_list: Answer | None = None  # GET /api/experimental/chats?limit=1
    status_query: Answer | None = None  # GET /api/v2/chats?limit=1&q=status:waiting


@dataclass(frozen=True, slots=True)
class RoutesObserved:
    """The client's own path through the chat routes: create → list → stream dial,
    then the doctor chat's archive."""

    create: Answer
    chat_id: str | None = None
    created_empty: bool = False
    listing: Answer | None = None
    listed: bool = False
    stream: Answer | None = None
    first_event: str | None = None
    archived: bool = False
    cleanup_error: str | None = None


@dataclass(frozen=True, slots=True)
class SmokeObserved:
    """One tiny turn through ``CoderAgent.generate`` in a doctor chat, then its archive."""

    chat_id: str | None
    reply: str | None = None
    latency_s: float | None = None
    error: str | None = None
    error_kind: str | None = None
    archived: bool = False
    cleanup_error: str | None = None


@dataclass(frozen=True, slots=True)
class StoreObserved:
    """The state store, read without writing: where it is and its schema version."""

    source: str
    expected_version: int
    backend: str | None = None  # "sqlite" | "postgresql"
    url: str | None = None  # never carries the password
    tenant: str | None = None
    exists: bool = True  # False: a SQLite file that is not there yet
    has_tables: bool = False
    version: int | None = None
    config_error: str | None = None
    connect_error: str | None = None


@dataclass(frozen=True, slots=True)
class PrefectObserved:
    """The Prefect API and the product's zombie-run automation."""

    api_url: str | None
    error: str | None = None
    server_version: str | None = None
    automation_name: str = ""
    automation_found: bool | None = None  # None: not looked up
    automation_enabled: bool | None = None
    flows_not_covered: tuple[str, ...] = ()
    automation_error: str | None = None

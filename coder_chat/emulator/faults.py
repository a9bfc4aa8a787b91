"""Fault registry: what the server shell should break next.

Pure bookkeeping (no I/O). The HTTP layer consults it per request / per upgrade / per frame;
the handle in ``server.py`` and the control API arm it. Time comes from ``time.monotonic``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any


def status_message(status: int) -> str:
    """The default message of a fault answering ``status``: its HTTP reason phrase, so a
    scripted 401 reads "Unauthorized" in the client's error, not some other status's text."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


@dataclass
class RestFault:
    """Fail, drop the response of, or delay the next ``remaining`` matching REST calls."""

    action: str  # "fail" | "drop_response" | "delay_commit" | "hold_commit"
    remaining: int
    method: str | None = None
    path: str | None = None  # substring of the request path
    status: int = 503
    message: str | None = None  # None: the status's reason phrase
    seconds: float = 0.0
    #: ``hold_commit``: the request that releases the held one (see :class:`Hold`).
    until_method: str | None = None
    until_path: str | None = None
    until_count: int = 1

    def error_message(self) -> str:
        """The ``message`` of the error envelope this fault answers with."""
        return self.message if self.message is not None else status_message(self.status)

    def matches(self, method: str, path: str) -> bool:
        """True when the rule applies to this request."""
        if self.method and self.method.upper() != method.upper():
            return False
        return not (self.path and self.path not in path)


@dataclass
class Hold:
    """A request held before it commits until ``remaining`` more matching requests
    (``method``/``path`` substring) have arrived: the held request commits right
    BEFORE the last of them is served, and that one waits for the commit.

    This orders a late commit deterministically between two reads of a client: the
    "send committed later than the commit horizon" window, where one read saw the
    chat before the commit and the next sees it after. ``max_seconds`` bounds the
    hold (the request then commits anyway), so a test that never sends the
    releasing request does not hang the server.
    """

    method: str | None
    path: str | None
    remaining: int
    max_seconds: float
    release: asyncio.Event = field(default_factory=asyncio.Event)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    held_path: str = ""

    def matches(self, method: str, path: str) -> bool:
        """True when this request counts towards the release."""
        if self.method and self.method.upper() != method.upper():
            return False
        return not (self.path and self.path not in path)


@dataclass
class UpgradeRefusal:
    """Refuse WebSocket upgrades with ``status`` until ``until`` or for ``remaining`` dials."""

    status: int
    until: float | None
    remaining: int | None
    chat_id: str | None = None
    path: str | None = None


@dataclass
class RouteRemoval:
    """Answer 404 ``Route not found.`` to requests whose path contains ``path`` (and whose
    method is ``method``, when set), REST calls and WebSocket upgrades alike: a build
    that does not serve the route. Lasts until cleared."""

    path: str
    method: str | None = None

    def matches(self, method: str, path: str) -> bool:
        """True when this request asks for the removed route."""
        if self.method and self.method.upper() != method.upper():
            return False
        return self.path in path


@dataclass
class DropRule:
    """Drop the next ``remaining`` matching streams after ``frames`` frames."""

    frames: int
    remaining: int
    chat_id: str | None = None
    code: int | None = None  # None = abort TCP without a close frame


@dataclass
class Stall:
    """Send no frames (and no pings) on matching streams until ``until``."""

    chat_id: str | None
    until: float | None


@dataclass
class FaultState:
    """All armed faults."""

    rest: list[RestFault] = field(default_factory=list)
    upgrades: list[UpgradeRefusal] = field(default_factory=list)
    drops: list[DropRule] = field(default_factory=list)
    stalls: list[Stall] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    removed: list[RouteRemoval] = field(default_factory=list)

    def clear(self) -> None:
        """Disarm everything (held requests commit now, removed routes come back)."""
        self.removed.clear()
        self.rest.clear()
        self.upgrades.clear()
        self.drops.clear()
        self.stalls.clear()
        for h in self.holds:
            h.release.set()
        self.holds.clear()

    def hold(self, fault: RestFault, path: str) -> Hold:
        """Register a request that a ``hold_commit`` fault holds (until released)."""
        h = Hold(fault.until_method, fault.until_path, fault.until_count, fault.seconds)
        h.held_path = path
        self.holds.append(h)
        return h

    def releases(self, method: str, path: str) -> list[Hold]:
        """Holds this request releases (it must wait for their commits before it is
        served); count it towards every other matching hold."""
        out = []
        for h in list(self.holds):
            if h.release.is_set() or not h.matches(method, path):
                continue
            h.remaining -= 1
            if h.remaining <= 0:
                h.release.set()
                self.holds.remove(h)
                out.append(h)
        return out

    def route_removed(self, method: str, path: str) -> bool:
        """True when a ``remove_route`` fault hides this request's route."""
        return any(r.matches(method, path) for r in self.removed)

    def take_rest(self, method: str, path: str) -> RestFault | None:
        """Consume the first matching REST fault, if any."""
        for f in self.rest:
            if f.remaining > 0 and f.matches(method, path):
                f.remaining -= 1
                if f.remaining == 0:
                    self.rest.remove(f)
                return f
        return None

    def take_upgrade_refusal(self, chat_id: str | None, path: str) -> int | None:
        """Status to refuse this upgrade with, or None to accept."""
        now = time.monotonic()
        for r in list(self.upgrades):
            if r.until is not None and now >= r.until:
                self.upgrades.remove(r)
                continue
            if r.chat_id and r.chat_id != chat_id:
                continue
            if r.path and r.path not in path:
                continue
            if r.remaining is not None:
                r.remaining -= 1
                if r.remaining <= 0:
                    self.upgrades.remove(r)
            return r.status
        return None

    def take_drop(self, chat_id: str | None) -> DropRule | None:
        """Assign a drop rule to a stream (on connect or when armed)."""
        for d in self.drops:
            if d.remaining > 0 and (d.chat_id is None or d.chat_id == chat_id):
                d.remaining -= 1
                if d.remaining == 0:
                    self.drops.remove(d)
                return d
        return None

    def stalled_until(self, chat_id: str | None) -> float | bool | None:
        """False when not stalled; else the monotonic end (None = until cleared)."""
        now = time.monotonic()
        for s in list(self.stalls):
            if s.until is not None and now >= s.until:
                self.stalls.remove(s)
                continue
            if s.chat_id is None or s.chat_id == chat_id:
                return s.until
        return False

    def describe(self) -> dict[str, Any]:
        """JSON view of armed faults."""
        return {
            "rest": [f.__dict__ for f in self.rest],
            "upgrades": [u.__dict__ for u in self.upgrades],
            "drops": [d.__dict__ for d in self.drops],
            "stalls": [s.__dict__ for s in self.stalls],
            "removed_routes": [r.__dict__ for r in self.removed],
            "holds": [
                {
                    "held_path": h.held_path,
                    "until_method": h.method,
                    "until_path": h.path,
                    "remaining": h.remaining,
                }
                for h in self.holds
            ],
        }

"""The Prefect server's clock, read once per reconciler tick.

The reconciler's destructive acts (mark a run Crashed, rerun it) rest on ages: how long
a run has been Pending, since its last heartbeat, since its state changed. Prefect's
server stamps those timestamps (a state's ``timestamp``, an event's ``received``) with
ITS clock. Subtracting them from the reconciler host's ``datetime.now()`` mixes two
clocks: a host running minutes ahead (NTP off, a VM resumed) sees a healthy run as
"Pending for minutes" and crashes it; one running behind never notices a lost run. So
every age is taken against the server's own "now", read here from the HTTP ``Date``
header of one cheap request (``/hello``: no database) per tick.

The header has one-second resolution (it is truncated to the second: the middle of that
second, and of the request's round trip, is taken), against graces of tens of seconds.
uvicorn (what ``prefect server start`` runs) also refreshes its ``Date`` only once a
second, so the estimate can be up to 1.5 s behind the server (plus half a round trip);
behind is the safe side: every age comes out shorter, an act comes later, never sooner.
A server that sends no usable ``Date`` (a proxy that strips it) leaves the host's clock:
that is logged once, at WARNING, naming the fix. A failed read (the server briefly
unreachable) reuses the last offset measured for that server, else the host's clock;
a tick that cannot reach the server reads no flow run either, and leaves every
workflow alone.

:func:`clock_from_date` is pure (tests/reconcile/test_server_clock.py); the read is
:func:`read_server_clock`. Imports nothing of ``prefect_coder``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Protocol

import httpx

__all__ = ["ServerClock", "clock_from_date", "read_server_clock"]

logger = logging.getLogger("prefect_coder.flows.reconcile")

#: An HTTP-date is truncated to the second: its middle is the best estimate.
_HALF_SECOND = timedelta(milliseconds=500)
#: The last offset measured per API URL (a failed read reuses it), and the URLs whose
#: missing ``Date`` was already logged (once per process).
_last: dict[str, ServerClock] = {}
_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class ServerClock:
    """The Prefect server's clock as this host sees it: ``offset`` = server minus host."""

    offset: timedelta = timedelta(0)
    #: ``server`` (measured from the server's ``Date``) or ``host`` (the fallback).
    source: str = "host"

    def now(self) -> datetime:
        """The server's "now" (UTC), from this host's clock plus the measured offset."""
        return datetime.now(UTC) + self.offset


def clock_from_date(date: str | None, sent: datetime, received: datetime) -> ServerClock | None:
    """The server clock from a response's ``Date`` header and this host's times of the
    request (``sent``) and its response (``received``); None if no usable date."""
    if not date:
        return None
    try:
        stamped = parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError):
        return None
    if stamped.tzinfo is None:  # "-0000": no zone information, not a time to trust
        return None
    server_at = stamped.astimezone(UTC) + _HALF_SECOND
    host_at = sent + (received - sent) / 2
    return ServerClock(offset=server_at - host_at, source="server")


class _Hello(Protocol):
    """What is asked of Prefect's client (``PrefectClient``): a cheap request."""

    @property
    def api_url(self) -> httpx.URL: ...

    async def hello(self) -> httpx.Response: ...


async def read_server_clock(client: _Hello) -> ServerClock:
    """The Prefect server's clock, from one ``GET /hello`` (see the module docstring)."""
    url = str(client.api_url)
    sent = datetime.now(UTC)
    try:
        response = await client.hello()
    except Exception as exc:
        last = _last.get(url)
        logger.warning(
            "could not read the Prefect server's clock (%s): using %s",
            type(exc).__name__,
            "its last known offset" if last else "this host's clock",
        )
        return last or ServerClock()
    clock = clock_from_date(response.headers.get("date"), sent, datetime.now(UTC))
    if clock is not None:
        _last[url] = clock
        return clock
    if url not in _warned:
        _warned.add(url)
        logger.warning(
            "the Prefect API at %s sent no usable Date header: the reconciler's ages "
            "(Pending, heartbeats, state changes) use this host's clock, and a skewed "
            "host clock can crash a live run or miss a lost one. Fix: serve the API "
            "through something that keeps the Date header (`prefect server start` and "
            "uvicorn send it; a proxy must not strip it), and keep this host's clock "
            "NTP-synchronised.",
            url,
        )
    return _last.get(url) or ServerClock()

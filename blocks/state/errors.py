"""Errors raised by the chat state store.

Every message names what to fix; none ever carries a password or token.
"""

from __future__ import annotations

import functools

from ..errors import PrefectCoderError


class StateStoreError(PrefectCoderError):
    """Base class for every state-store failure."""


class StateStoreConfigError(StateStoreError, ValueError):
    """Bad configuration (URL, tenant, ...): the message names the field and the fix."""


class SchemaVersionError(StateStoreError):
    """The database holds a schema newer than this code understands."""


class SchemaChangedError(SchemaVersionError):
    """A write refused because the database's schema version is no longer this code's:
    newer code migrated the store while this worker ran (a rolling upgrade). Nothing
    was written.

    Permanent for this process (``retryable`` False): the same step run again on THIS
    worker is refused again; an upgraded worker may run it (its chat stays live: the
    step's recovery on the upgraded worker takes it from its checkpoint and journal).
    ``found``: the database's version (None: no version row); ``supported``: this code's.
    """

    def __init__(self, found: int | None, supported: int) -> None:
        self.found = found
        self.supported = supported
        what = (
            "has no schema version row"
            if found is None
            else f"was migrated to schema version {found}"
        )
        super().__init__(
            f"the state database {what} while this worker runs prefect-coder for schema "
            f"version {supported}; nothing was written. Upgrade prefect-coder on this "
            "worker and restart it (every worker sharing a store must run the new "
            'release: docs/state-store.md, "Upgrading"); the step can be re-run by an '
            "upgraded worker"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.found, self.supported))


class LeaseUnavailableError(StateStoreError):
    """Waiting for a lease timed out while another holder still held it."""

    def __init__(self, key: str, *, holder: str | None, expires_in: float | None, waited: float):
        self.key = key
        self.holder = holder
        self.expires_in = expires_in
        self.waited = waited
        who = f"held by {holder!r}" if holder else "held by another holder"
        when = f", expires in {expires_in:.2f}s unless renewed" if expires_in is not None else ""
        super().__init__(
            f"lease {key!r} is {who}{when}; gave up after waiting {waited:.2f}s "
            "(another step is running on this chat/workflow: run steps sequentially, "
            "or raise `wait`)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled with its fields (Prefect persists a failed run's exception).
        return (
            functools.partial(
                type(self), holder=self.holder, expires_in=self.expires_in, waited=self.waited
            ),
            (self.key,),
        )


class LeaseLostError(StateStoreError):
    """A held lease could no longer be renewed (it expired and was taken over)."""

    def __init__(self, key: str, holder: str, *, fence: int | None = None):
        self.key = key
        self.holder = holder
        #: Set when a write was refused: the fence the writer held (the row now carries
        #: another holder or fence), and nothing of that write was stored.
        self.fence = fence
        why = (
            f"was taken over (the row no longer carries fence {fence}); the write was "
            "refused and nothing was written"
            if fence is not None
            else "was lost (not renewed within its ttl, or taken over)"
        )
        super().__init__(
            f"lease {key!r} held by {holder!r} {why}; another holder may now be running: "
            "stop acting on this key"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (functools.partial(type(self), fence=self.fence), (self.key, self.holder))


class StoreUnavailableError(StateStoreError):
    """The store could not be reached or was busy for longer than its own retries
    (``transient_retry_s``): a transient fault (``faults.is_transient``), not a bug.

    ``retryable``: the step that hit it may run again (Prefect's task retries, a rerun,
    ``recover-turn``); its chat stays live. The message names the store (its URL
    without a password) and what to check; ``cause`` is the last fault's short name.
    ``outcome_unknown``: the last attempt was a write whose connection died while it
    was in flight — it may have committed.
    """

    retryable = True
    #: The chat of the step that hit it, when the step knows it (the failure handler
    #: names it in ``coder.workflow.resumable`` without asking the store).
    chat_id: str | None = None

    def __init__(
        self,
        store: str,
        cause: str,
        *,
        backend: str = "",
        waited: float = 0.0,
        attempts: int = 1,
        outcome_unknown: bool = False,
    ) -> None:
        self.store = store
        self.cause = cause
        self.backend = backend
        self.waited = waited
        self.attempts = attempts
        self.outcome_unknown = outcome_unknown
        check = (
            "check that no other process holds the SQLite file's write lock for long "
            "(a stopped or stuck worker) and that its disk is not full; raise "
            "`connect_timeout` or `transient_retry_s` on the ChatStateStore block if "
            "long writes are expected"
            if backend == "sqlite"
            else "check that PostgreSQL is up and reachable from this worker (restart, "
            "failover, network, max_connections); raise `transient_retry_s` on the "
            "ChatStateStore block to ride out longer restarts"
        )
        unknown = (
            " The last write's connection died in flight: it may have committed."
            if outcome_unknown
            else ""
        )
        super().__init__(
            f"state store {store} unavailable after {attempts} attempt(s) in "
            f"{waited:.1f}s ({cause}); {check}. The step may be retried: its chat stays "
            f"live.{unknown}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled with its fields (Prefect persists a failed run's exception).
        return (
            functools.partial(
                type(self),
                backend=self.backend,
                waited=self.waited,
                attempts=self.attempts,
                outcome_unknown=self.outcome_unknown,
            ),
            (self.store, self.cause),
            {"chat_id": self.chat_id},
        )

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

    def __init__(self, key: str, holder: str):
        self.key = key
        self.holder = holder
        super().__init__(
            f"lease {key!r} held by {holder!r} was lost (not renewed within its ttl); "
            "another holder may now be running: stop acting on this key"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.key, self.holder))

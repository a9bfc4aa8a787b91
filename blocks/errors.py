"""The root of every error prefect-coder raises (the client's own live in
:mod:`coder_chat.errors`; :mod:`prefect_coder.errors` gathers all of the product's).

Here, at the bottom of the product's packages, so that the store (Prefect-free) and
the flows derive from one class without importing each other.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["PrefectCoderError"]


class PrefectCoderError(Exception):
    """Base class of every error raised by ``prefect_coder`` (blocks, store, flows).

    ``retryable`` — the one spelling of retryability in the product — says whether
    the same step, run again, may succeed: the failure was transient (a slot lost
    before anything was sent, a store that was briefly unreachable). It says nothing
    about whether the chat is safe to archive (that is the failure handler's
    positive verdict).
    """

    retryable: ClassVar[bool] = False

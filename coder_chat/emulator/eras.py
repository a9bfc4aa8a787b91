"""Server builds ("eras") the emulator can play, and what differs between them.

The chatd wire spec pins three builds of the current (chatstate) era, in feature order:
B1 < B2 < B3. Every behaviour that differs is one field of :class:`Era`; the routes,
stream cursor and transitions read the field, never the era's name. Choices where the spec
says "unconfirmed" are marked here and listed in docs/emulator.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

V2_PREFIX: Final = "/api/v2/chats"
EXPERIMENTAL_PREFIX: Final = "/api/experimental/chats"


@dataclass(frozen=True)
class Era:
    """One server build's wire-visible behaviour."""

    name: str
    # URL prefixes that serve the core chat routes (B3: /api/v2 only).
    prefixes: tuple[str, ...]
    # The /stream revision cursor: None (B1: only after_id), "after_revision" (B2) or
    # "history_version" (B3; also makes a non-zero value override after_id).
    stream_cursor: str | None
    # `status` stream events carry history_version (B2 and later).
    status_history_version: bool
    # GET /chats `q`: `status:`, `archived:any`, `pr_status:none` (B2 and later).
    status_search: bool
    # GET /chats `q`: the `search:` key ("newest builds only"; B2 unconfirmed: kept on,
    # as the emulator always did; B1 rejects it as an unknown key).
    search_key: bool
    # POST /chats accepts empty content (→ waiting, "New Chat") and a `title` (B3).
    empty_content_create: bool
    create_title: bool
    # Interrupt (and send with busy_behavior=interrupt) of a chat no worker owns
    # finishes the interruption in the same transaction (B3).
    unowned_interrupt_finishes: bool
    # PATCH /chats/{chat} validates every field before the first write (B3).
    patch_validates_first: bool
    # GET /messages carries turn_start_id (DESC pages) and history_version (newest page).
    messages_history_version: bool
    # A promoted queue head carries queued_message_id (B1's ChatMessage has no such
    # field; B2 unconfirmed: kept on, as the emulator always did).
    stamp_queued_message_id: bool
    # /api/v2/chats/models is a reserved 404 (B1: only on the experimental mount, so on
    # v2 the word falls into the {chat} wildcard → 400; B2/B3 unconfirmed: reserved).
    v2_reserves_models: bool


B1: Final = Era(
    name="b1",
    prefixes=(EXPERIMENTAL_PREFIX, V2_PREFIX),
    stream_cursor=None,
    status_history_version=False,
    status_search=False,
    search_key=False,
    empty_content_create=False,
    create_title=False,
    unowned_interrupt_finishes=False,
    patch_validates_first=False,
    messages_history_version=False,
    stamp_queued_message_id=False,
    v2_reserves_models=False,
)
B2: Final = Era(
    name="b2",
    prefixes=(EXPERIMENTAL_PREFIX, V2_PREFIX),
    stream_cursor="after_revision",
    status_history_version=True,
    status_search=True,
    search_key=True,
    empty_content_create=False,
    create_title=False,
    unowned_interrupt_finishes=False,
    patch_validates_first=False,
    messages_history_version=False,
    stamp_queued_message_id=True,
    v2_reserves_models=True,
)
B3: Final = Era(
    name="b3",
    prefixes=(V2_PREFIX,),
    stream_cursor="history_version",
    status_history_version=True,
    status_search=True,
    search_key=True,
    empty_content_create=True,
    create_title=True,
    unowned_interrupt_finishes=True,
    patch_validates_first=True,
    messages_history_version=True,
    stamp_queued_message_id=True,
    v2_reserves_models=True,
)

ERAS: Final[dict[str, Era]] = {e.name: e for e in (B1, B2, B3)}
ERA_NAMES: Final = tuple(ERAS)
NEWEST: Final = "b3"
# The newest build by default: what a new deployment runs. Tests that fake an older
# server pin their era explicitly.
DEFAULT_ERA: Final = NEWEST


ERA_ENV: Final = "CODER_CHAT_EMULATOR_ERA"


def default_era() -> str:
    """The era an emulator plays when none is named: ``$CODER_CHAT_EMULATOR_ERA`` if set
    (so a whole test suite can be run against another build without edits), else
    :data:`DEFAULT_ERA`."""
    return era(os.environ.get(ERA_ENV) or DEFAULT_ERA).name


def era(name: str | Era) -> Era:
    """The :class:`Era` called ``name`` (``"b1"``, ``"b2"``, ``"b3"``, any case)."""
    if isinstance(name, Era):
        return name
    try:
        return ERAS[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown era {name!r}; expected one of {', '.join(ERAS)}") from None


__all__ = [
    "B1",
    "B2",
    "B3",
    "DEFAULT_ERA",
    "ERAS",
    "ERA_ENV",
    "ERA_NAMES",
    "NEWEST",
    "Era",
    "default_era",
    "era",
]

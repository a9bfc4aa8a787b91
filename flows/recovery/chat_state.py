"""Is the checkpointed chat archived? Known from this process's own REST answers, else
asked once — so no step ever sends to an archived chat (issue 30, item 3).

An archived chat takes no message (400 ``Cannot send messages to an archived chat``):
a step sending to one fails, every rerun with it. Recovery's history path already
reads the chat and takes the archived-chat path (``from_history._on_archived``: the
finished steps from its history, the rest in a fresh chat, adopting an orphan); the
common send — the journal names an EARLIER step, which proves this one never sent —
read nothing. Every path that sends to the checkpoint's chat goes through
``recover_before_send`` (``run_turn``; ``recover-turn`` resubmits through
``run_turn``; the fan-out shard runs ``run_steps``), and there it asks
:func:`chat_archived` before the common send.

Free where the chat's state is known: a chat a turn of this process settled on (or
created) is live, a chat this process saw archived or archived itself is archived;
only a chat this process knows nothing of (the first send of a rerun, a new shard) is
read, once. A chat archived by someone else after this process saw it live still meets
the 400; the step then fails without an archive (not a final failure), and the rerun —
a new process — reads the chat and continues in a fresh one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from coder_chat.rest import ChatClient

__all__ = ["chat_archived", "forget", "known_archived", "note_archived", "note_live"]

#: Chats remembered per process (a fan-out shard drives many workflows).
_MAX = 8192
_lock = threading.Lock()
_known: OrderedDict[str, bool] = OrderedDict()


def _note(chat_id: str | None, archived: bool) -> None:
    if not chat_id:
        return
    with _lock:
        _known[chat_id] = archived
        _known.move_to_end(chat_id)
        while len(_known) > _MAX:
            _known.popitem(last=False)


def note_live(chat_id: str | None) -> None:
    """A turn of this process just settled on (or created) ``chat_id``."""
    _note(chat_id, False)


def note_archived(chat_id: str | None) -> None:
    """This process archived ``chat_id``, or saw it archived."""
    _note(chat_id, True)


def forget(chat_id: str) -> None:
    """Know nothing of ``chat_id`` any more (tests; a chat whose state is in doubt)."""
    with _lock:
        _known.pop(chat_id, None)


def known_archived(chat_id: str) -> bool | None:
    """True/False when this process knows; None when it would have to ask."""
    with _lock:
        return _known.get(chat_id)


async def chat_archived(client: ChatClient, chat_id: str, *, bound_s: float) -> bool:
    """Whether ``chat_id`` is archived: from what this process knows, else one read."""
    known = known_archived(chat_id)
    if known is not None:
        return known
    chat = await client.get_chat(chat_id, timeout=bound_s)
    _note(chat_id, bool(chat.archived))
    return bool(chat.archived)

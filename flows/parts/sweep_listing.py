"""What a sweep starts from: every chat this collection labelled, and the store's accounting."""

from __future__ import annotations

from coder_chat.models import Chat
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.flows.parts.labels import scope_labels
from prefect_coder.flows.parts.sweep_plan import Accounting

__all__ = ["list_owned_chats", "store_accounting"]


async def list_owned_chats(
    client: ChatClient,
    tenant: str,
    *,
    archived: bool | None,
    page_size: int = 200,
    overlap: int = 5,
    request_timeout_s: float | None = None,
) -> dict[str, Chat]:
    """Every chat labelled by this collection for ``tenant``, by id (archived, unarchived
    or both for ``None``).

    Pages by offset until a short page. Each page starts ``overlap`` chats before the
    previous one ended: a chat leaving the listing meanwhile (archived by this or
    another sweep) shifts the rest forward, and the overlap re-reads what shifted
    instead of skipping it. Duplicates collapse by id; a chat missed anyway (more
    shifts than the overlap) is found by the next sweep.
    """
    labels = scope_labels(tenant)
    overlap = max(0, min(overlap, page_size - 1))
    states = [False, True] if archived is None else [archived]
    seen: dict[str, Chat] = {}
    for state in states:
        offset = 0
        while True:
            page = await client.list_chats(
                q=f"archived:{'true' if state else 'false'}",
                labels=labels,
                limit=page_size,
                offset=offset,
                timeout=request_timeout_s,
            )
            for chat in page:
                seen[chat.id] = chat
            if len(page) < page_size:
                break
            offset += page_size - overlap
    return seen


async def store_accounting(store: StateStore) -> Accounting:
    """Which chats the store accounts for (checkpoints) or records stranded."""
    checkpoints = await store.checkpoints.list()
    stranded = await store.stranded.list()
    return Accounting(
        tenant=store.tenant,
        checkpointed={c.chat_id: c.workflow_id for c in checkpoints},
        stranded={s.chat_id: (s.workflow_id, s.reason) for s in stranded},
    )

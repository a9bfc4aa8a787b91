"""What a sweep starts from: every chat this collection labelled, and the store's accounting."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from coder_chat.errors import is_transient
from coder_chat.models import Chat
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.labels import scope_labels
from prefect_coder.flows.sweeps.plan import Accounting

__all__ = ["LISTING_RETRY_BACKOFF_S", "list_owned_chats", "store_accounting"]

#: Waits before re-reading a listing page after a transient failure (a 5xx, 429, a
#: reset connection): a page read is idempotent, and a sweep run that fails on one
#: listing error (e.g. a restart of the deployment) sweeps nothing until its next tick.
LISTING_RETRY_BACKOFF_S = (0.5, 1.0, 2.0)


async def list_owned_chats(
    client: ChatClient,
    tenant: str,
    *,
    archived: bool | None,
    page_size: int = 200,
    overlap: int = 5,
    request_timeout_s: float | None = None,
    retry_backoff_s: Sequence[float] = LISTING_RETRY_BACKOFF_S,
) -> dict[str, Chat]:
    """Every chat labelled by this collection for ``tenant``, by id (archived, unarchived
    or both for ``None``).

    Pages by offset until a short page. Each page starts ``overlap`` chats before the
    previous one ended: a chat leaving the listing meanwhile (archived by this or
    another sweep) shifts the rest forward, and the overlap re-reads what shifted
    instead of skipping it. Duplicates collapse by id; a chat missed anyway (more
    shifts than the overlap) is found by the next sweep. A page whose read fails
    transiently (:func:`coder_chat.errors.is_transient`) is read again after each
    of ``retry_backoff_s``; then the failure is raised.
    """
    labels = scope_labels(tenant)
    overlap = max(0, min(overlap, page_size - 1))
    states = [False, True] if archived is None else [archived]
    seen: dict[str, Chat] = {}
    for state in states:
        offset = 0
        while True:
            for backoff in (*retry_backoff_s, None):
                try:
                    page = await client.list_chats(
                        q=f"archived:{'true' if state else 'false'}",
                        labels=labels,
                        limit=page_size,
                        offset=offset,
                        timeout=request_timeout_s,
                    )
                    break
                except Exception as exc:
                    if backoff is None or not is_transient(exc):
                        raise
                    await asyncio.sleep(backoff)
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
        store_id=await store.identity(),
        checkpointed={c.chat_id: c.workflow_id for c in checkpoints},
        stranded={s.chat_id: (s.workflow_id, s.reason) for s in stranded},
    )

"""The orphan check survives a transient failure of the chat listing: a 503 on
``GET /chats`` failed a whole ``recover-turn`` run (chaos seed 89); the check is
idempotent, so it is run again after a short backoff."""

from __future__ import annotations

import pytest

from coder_chat.emulator import Emulator
from coder_chat.errors import CoderApiError
from coder_chat.models import ChatInputPart, CreateChatRequest
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.common.labels import chat_labels
from prefect_coder.flows.recovery.orphans import RETRY_BACKOFF_S, strand_workflow_orphans


async def _orphan(creds: CoderCredentials, emu: Emulator, store: StateStore, wid: str) -> str:
    async with creds.get_client() as client:
        chat = await client.create_chat(
            CreateChatRequest(
                organization_id=str(emu.organization_id),
                content=[ChatInputPart.text_part("hi")],
                labels=chat_labels(store.tenant, wid),
            )
        )
    return chat.id


async def test_a_503_on_the_listing_is_retried(
    emu: Emulator, coder_block: str, store: StateStore, workflow_id: str
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    orphan = await _orphan(creds, emu, store, workflow_id)
    emu.faults.fail_rest(2, status=503, method="GET", path="/chats")
    try:
        async with creds.get_client() as client:
            found = await strand_workflow_orphans(client, store, workflow_id)
            # Both faults were used up by the check's own listings: the next one passes.
            await client.list_chats(limit=1)
    finally:
        emu.faults.clear()
    assert found == [orphan]
    assert orphan in {s.chat_id for s in await store.stranded.list()}


async def test_a_permanent_failure_still_fails(
    emu: Emulator, coder_block: str, store: StateStore, workflow_id: str
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    await _orphan(creds, emu, store, workflow_id)
    emu.faults.fail_rest(len(RETRY_BACKOFF_S) + 1, status=503, method="GET", path="/chats")
    try:
        async with creds.get_client() as client:
            with pytest.raises(CoderApiError) as err:
                await strand_workflow_orphans(client, store, workflow_id)
        assert err.value.status == 503
    finally:
        emu.faults.clear()
    # Not retried at all: a 403 is the same on every attempt.
    emu.faults.fail_rest(1, status=403, method="GET", path="/chats")
    try:
        async with creds.get_client() as client:
            with pytest.raises(CoderApiError) as err:
                await strand_workflow_orphans(client, store, workflow_id)
        assert err.value.status == 403
    finally:
        emu.faults.clear()

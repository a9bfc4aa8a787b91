"""Helpers of the sweep tests (imported as a module, not via conftest)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from coder_chat.models import ChatInputPart, CreateChatRequest, DynamicToolDefinition
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.labels import chat_labels

ORG_FIELD = "organization_id"


def directive(script: Any) -> str:
    """The in-text directive that scripts the emulator's model for this prompt."""
    return " #emu " + json.dumps(script)


async def new_chat(
    client: ChatClient,
    *,
    labels: dict[str, str] | None,
    script: Any = None,
    prompt: str = "hello",
    tools: list[str] = (),  # type: ignore[assignment]
) -> str:
    """Create a chat over the wire (what a turn does before its checkpoint exists)."""
    text = prompt + (directive(script) if script is not None else "")
    chat = await client.create_chat(
        CreateChatRequest(
            organization_id=str(client.organization_id),
            content=[ChatInputPart.text_part(text)],
            labels=labels,
            unsafe_dynamic_tools=[
                DynamicToolDefinition(name=t, input_schema={"type": "object"}) for t in tools
            ]
            or None,
        )
    )
    return chat.id


def ours(tenant: str, workflow_id: str) -> dict[str, str]:
    return chat_labels(tenant, workflow_id, "00000000-0000-4000-8000-000000000001")


async def wait_status(
    client: ChatClient, chat_id: str, *statuses: str, within: float = 10.0
) -> str:
    """Poll until the chat reaches one of ``statuses``; returns it."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        status = (await client.get_chat(chat_id)).status
        if status in statuses:
            return status
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"chat {chat_id} stayed {status}, wanted {statuses}")
        await asyncio.sleep(0.02)


async def snapshot(client: ChatClient, store: StateStore, chat_ids: list[str]) -> dict[str, Any]:
    """Everything a sweep could change: chat status/archived, checkpoints, stranded,
    journal and ledger."""
    chats = {}
    for cid in chat_ids:
        c = await client.get_chat(cid)
        chats[cid] = (c.status, c.archived)
    return {
        "chats": chats,
        "checkpoints": [(c.workflow_id, c.chat_id) for c in await store.checkpoints.list()],
        "stranded": [s.chat_id for s in await store.stranded.list()],
        "journal": {cid: await store.journal.get(cid) for cid in chat_ids},
        "ledger": {cid: await store.ledger.list(cid) for cid in chat_ids},
    }

"""Test-only crash-safe client tool ``charge_card`` (registered by name at import).

Listed in ``WorkflowSettings.tool_modules`` by the recovery tests. It charges the
test payments service at ``$PAYMENTS_URL`` with the ledger's key as the
Idempotency-Key, so the service counts each effect once per key.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
from pydantic import BaseModel

from coder_chat.crash_safe import EffectContext, crash_safe_tool
from flows.registry import register_tool


class Charge(BaseModel):
    """Arguments of ``charge_card``."""

    amount_cents: int


@crash_safe_tool(name="charge_card", description="Charge the customer's card.")
async def charge_card(args: Charge, ctx: EffectContext) -> dict[str, Any]:
    """Charge through the payments service; the ledger key is the idempotency key."""
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(
            f"{os.environ['PAYMENTS_URL']}/charge",
            json={"amount_cents": args.amount_cents},
            headers={"Idempotency-Key": ctx.idempotency_key},
        )
        resp.raise_for_status()
        return dict(resp.json())


register_tool(charge_card)

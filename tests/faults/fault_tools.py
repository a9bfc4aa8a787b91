"""A registered tool for the fault tests' workflows: ``fault_charge`` charges through the
key-honouring :class:`faults_effects.EffectLog` in the file ``$FAULTS_EFFECT_LOG``.

Declared with plain ``@registered_tool``: the workflow runs it behind the ledger
(crash-safe by default), and its ``ctx.idempotency_key`` is the ledger key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from faults_effects import EffectLog
from pydantic import BaseModel

from coder_chat.tools import ToolContext
from prefect_coder.tools import registered_tool


class FaultCharge(BaseModel):
    """Arguments of ``fault_charge``."""

    amount_cents: int


@registered_tool(name="fault_charge", description="Charge the customer's card.")
async def fault_charge(args: FaultCharge, ctx: ToolContext) -> dict[str, Any]:
    """One charge per idempotency key, every request logged."""
    log = EffectLog(Path(os.environ["FAULTS_EFFECT_LOG"]))
    return log.charge(ctx.idempotency_key, args.amount_cents)

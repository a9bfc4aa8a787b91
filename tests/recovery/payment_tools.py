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
from coder_chat.rest import shared_ssl_context
from prefect_coder.tools import register_tool


class Charge(BaseModel):
    """Arguments of ``charge_card``."""

    amount_cents: int


@crash_safe_tool(name="charge_card", description="Charge the customer's card.")
async def charge_card(args: Charge, ctx: EffectContext) -> dict[str, Any]:
    """Charge through the payments service; the ledger key is the idempotency key."""
    # The process's one TLS context (the payments service is plain HTTP): a client's
    # own would load the CA bundle per charge (≈ 40 ms of CPU each).
    async with httpx.AsyncClient(timeout=10, verify=shared_ssl_context(True)) as client:
        resp = await client.post(
            f"{os.environ['PAYMENTS_URL']}/charge",
            json={"amount_cents": args.amount_cents},
            headers={"Idempotency-Key": ctx.idempotency_key},
        )
        resp.raise_for_status()
        return dict(resp.json())


register_tool(charge_card)


def _crash_once_from_env() -> None:
    """Test seam for the Crashed-trigger test: a process started by a Prefect runner
    (no fork server to tell it) SIGKILLs itself at the crash point of
    ``$CRASH_PLAN_FILE`` — JSON ``{"at": "<point>:<n>", "once": PATH}`` — once per
    ``once`` file across processes, so the recovery run is not killed too. The file is
    read at each crash point, not at import: one runner serves several tests, each
    writing its own plan before it starts its run."""
    plan_file = os.environ.get("CRASH_PLAN_FILE")
    if not plan_file:
        return
    import json
    import signal

    from coder_chat.crash_safe import add_crash_hook

    seen: dict[str, int] = {}

    def hook(point: str) -> None:
        seen[point] = seen.get(point, 0) + 1
        try:
            with open(plan_file) as f:
                plan = json.load(f)
        except (OSError, ValueError):
            return  # no plan: no crash
        name, _, nth = str(plan.get("at") or "").partition(":")
        if point != name or seen[point] != int(nth or 1):
            return
        try:
            fd = os.open(plan["once"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # already crashed once: this is the recovery
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    add_crash_hook(hook)


_crash_once_from_env()

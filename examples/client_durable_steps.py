"""Durable-step shape with coder_chat alone (no Prefect): one turn per step,
checkpoint in ``finally``, resume in a fresh agent, recover a finished turn from
history instead of resubmitting it.

    .venv/bin/python examples/client_durable_steps.py

Uses CODER_URL / CODER_SESSION_TOKEN / CODER_ORG_ID when set, else a local emulator.
``flows/`` implements the full design (journal, tool ledger, settle-wait) on Prefect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from _example_env import require_project

require_project(__file__)

from coder_chat import CoderAgent  # noqa: E402
from coder_chat.history import fetch_turn, marker_attempts, recover_turn_result  # noqa: E402

CHECKPOINTS: dict[str, dict[str, Any]] = {}  # stand-in for a durable store


@contextlib.asynccontextmanager
async def deployment() -> AsyncIterator[dict[str, str]]:
    if os.environ.get("CODER_URL"):
        yield {}
        return
    from coder_chat.emulator.server import Emulator

    async with Emulator() as emu:
        yield {"base_url": emu.base_url, "token": emu.token, "organization_id": emu.organization_id}


async def run_step(creds: dict[str, str], workflow_id: str, step: str, prompt: str) -> str:
    checkpoint = CHECKPOINTS.get(workflow_id, {})
    agent = CoderAgent(
        **creds,
        chat_id=checkpoint.get("chat_id"),
        last_seen_message_id=checkpoint.get("last_seen_message_id"),
        request_timeout=300,  # per segment
    )
    marker = f"[{workflow_id}/{step}]"  # stable across this step's retries
    try:
        return (await agent.generate(f"{marker} {prompt}", timeout=600)).text
    finally:
        # Checkpoint even when the turn failed: a failed-but-alive chat stays reachable.
        if agent.chat_id:
            CHECKPOINTS[workflow_id] = {
                "chat_id": agent.chat_id,
                "last_seen_message_id": agent.last_seen_message_id,
            }
        await agent.aclose()  # never archive per step


async def recover_step(creds: dict[str, str], workflow_id: str, step: str) -> str | None:
    """After a crash that lost the step's result: was it submitted and finished?"""
    chat_id = CHECKPOINTS[workflow_id]["chat_id"]
    agent = CoderAgent(**creds, chat_id=chat_id)
    try:
        marker = f"[{workflow_id}/{step}]"
        attempts = await marker_attempts(agent.client, chat_id, marker)
        turn = await fetch_turn(agent.client, chat_id)
        rec = recover_turn_result(turn, client_tool_names=agent.client_tool_names, marker=marker)
        print(f"  {marker}: {attempts} attempt(s) in history, submitted={rec and rec.submitted}")
        return rec.text if rec and rec.submitted else None
    finally:
        await agent.aclose()


async def main() -> None:
    async with deployment() as creds:
        print("step 1:", await run_step(creds, "wf-1042", "step-1", "Investigate the build."))
        print("step 2:", await run_step(creds, "wf-1042", "step-2", "Apply the fix."))
        # pretend step 2's process died after the turn finished but before recording it
        print("recovered step 2:", await recover_step(creds, "wf-1042", "step-2"))
        # the workflow's final step archives, once
        final = CoderAgent(**creds, chat_id=CHECKPOINTS["wf-1042"]["chat_id"])
        print("archived:", (await final.archive()).archived_chat_ids)
        await final.aclose()


if __name__ == "__main__":
    asyncio.run(main())

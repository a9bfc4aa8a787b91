"""Run the demo workflow through the ``agent-workflow`` deployment and print it.

Three steps on one chat: the model calls the ``lookup_build`` client tool (it
runs in the worker's flow-run process), files a structured ``fix_plan``, and
summarises. The ``#emu`` directives script the local emulator's model; a real
Coder deployment would answer the prompts with a real model instead.

Then the same workflow id runs again: every step comes back from Prefect's
result storage and the chat gets zero new messages.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from coder_chat.rest import ChatClient

DEPLOYMENT = "agent-workflow/agent-workflow"


def demo_steps() -> list[dict[str, Any]]:
    """The three steps, each scripting the emulator's model with an #emu directive."""

    def emu(script: object) -> str:
        return " #emu " + json.dumps(script)

    return [
        {
            "name": "investigate",
            "prompt": "Investigate why the nightly build nightly-1042 fails."
            + emu(
                [
                    {
                        "text": "Let me look the build up.",
                        "tool_calls": [
                            {"name": "lookup_build", "args": {"build_id": "nightly-1042"}}
                        ],
                    },
                    {
                        "text": "nightly-1042 fails in test_parse_iso_week: ISO week "
                        "numbers come out one too low."
                    },
                ]
            ),
            "tools": ["lookup_build"],
        },
        {
            "name": "propose",
            "prompt": "Propose a fix as a structured plan."
            + emu(
                [
                    {
                        "structured_output": {
                            "summary": "Count ISO weeks from 1, not 0, in parse_iso_week.",
                            "files": ["src/dates.py", "tests/test_dates.py"],
                            "risk": "low",
                        }
                    },
                    {"text": "Plan filed."},
                ]
            ),
            "output_model": "fix_plan",
        },
        {
            "name": "summarize",
            "prompt": "Summarize what you found and what you propose, in one sentence."
            + emu(
                {
                    "text": "The nightly build fails because ISO weeks are counted from 0; "
                    "counting from 1 in src/dates.py fixes it (low risk)."
                }
            ),
        },
    ]


def show(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"\n--- step {r['step']} (chat {r['chat_id']}, attempt {r['attempt']}) ---")
        for call in r.get("tool_calls") or []:
            print(
                f"  tool {call['name']} [{call['kind']}] {json.dumps(call.get('args'))}"
                f" -> {json.dumps(call.get('output'))[:160]}"
            )
        if r.get("structured") is not None:
            print(f"  structured: {json.dumps(r['structured'])}")
        print(f"  answer: {r['text']}")
        usage = r.get("usage") or {}
        tokens = f"{usage.get('input_tokens', '?')} in / {usage.get('output_tokens', '?')} out"
        print(f"  finish={r['finish_reason']} tokens={tokens} generate={r['generate_ms']:.0f} ms")


async def run(workflow_id: str) -> tuple[Any, list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    flow_run = await run_deployment(
        DEPLOYMENT,
        parameters={"workflow_id": workflow_id, "steps": demo_steps()},
        timeout=300,
        poll_interval=1,
    )
    elapsed = time.perf_counter() - t0
    state = flow_run.state
    if state is None or not state.is_completed():
        print(f"flow run {flow_run.name} ended {state and state.name}: {state and state.message}")
        async with get_client() as client:
            logs = await client.read_logs()
        for log in logs[-40:]:
            if log.flow_run_id == flow_run.id:
                print(f"  {log.message}")
        sys.exit(1)
    raw = await state.aresult()
    results = [r.model_dump(mode="json") if hasattr(r, "model_dump") else r for r in raw]
    return flow_run, results, elapsed


async def count_messages(chat_id: str) -> int:
    async with ChatClient(
        os.environ["CODER_URL"],
        os.environ["CODER_SESSION_TOKEN"],
        organization_id=os.environ.get("CODER_ORG_ID"),
    ) as client:
        page = await client.get_messages(chat_id, limit=200)
    return len(page.messages)


async def main() -> None:
    workflow_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"    workflow {workflow_id}: investigate → propose → summarize")
    flow_run, results, elapsed = await run(workflow_id)
    show(results)
    ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
    print(
        f"\nflow run {flow_run.name} completed in {elapsed:.1f} s (worker process start included)"
    )
    print(f"  UI: {ui}/runs/flow-run/{flow_run.id}")

    chat_id = results[0]["chat_id"]
    before = await count_messages(chat_id)
    print(f"\nre-running workflow {workflow_id} (same id): finished steps come from storage")
    _, again, elapsed = await run(workflow_id)
    after = await count_messages(chat_id)
    same = [a["text"] for a in again] == [r["text"] for r in results]
    print(
        f"  {len(again)} step results returned in {elapsed:.1f} s, identical={same}, "
        f"new chat messages: {after - before}"
    )
    if not same or after != before:
        sys.exit("the re-run changed the chat: durability is broken")


if __name__ == "__main__":
    asyncio.run(main())

"""A durable two-step workflow on the local emulator — run it, look, run it again.

    .venv/bin/python examples/durable_turns.py

What it shows (docs/durable-turns.md walks through it):

1. ``agent_workflow`` runs two steps as turns of one chat; the first step calls
   the ``lookup_build`` client tool, which runs in this process.
2. The checkpoint (chat id + cursor) is in the state store; the results are in
   Prefect's result storage under one key per (workflow, step).
3. Running the same workflow id again returns the stored results and sends no
   message; the chat is archived only once, at the end.
4. A step that times out still checkpoints the chat it created.

Prefect server: ``PREFECT_API_URL`` when set; else the one ``scripts/demo`` runs (its
UI shows the runs); else Prefect's temporary local server (PREFECT_HOME in a temp dir).
"""

from __future__ import annotations

import asyncio
import json
import time

from _example_env import require_project, use_prefect_server

require_project(__file__)
print(use_prefect_server())

from coder_chat.emulator import Emulator  # noqa: E402
from prefect_coder.blocks import ChatStateStore, CoderCredentials  # noqa: E402
from prefect_coder.flows import Step, WorkflowSettings, result_key  # noqa: E402
from prefect_coder.flows.deployments.agent_workflow import agent_workflow  # noqa: E402


def scripted(text: str, script: object) -> str:
    """A prompt plus the emulator directive that scripts its model's answer."""
    return f"{text} #emu {json.dumps(script)}"


async def main() -> None:
    with Emulator.running_in_thread() as emu:
        await CoderCredentials(
            base_url=emu.base_url, organization_id=emu.organization_id, token=emu.token
        ).save("example-coder", overwrite=True)
        settings = WorkflowSettings(credentials_block="example-coder", retry_delay_s=1)
        workflow_id = f"example-{time.strftime('%H%M%S')}"
        steps = [
            Step(
                name="investigate",
                prompt=scripted(
                    "Why does nightly-7 fail?",
                    [
                        {
                            "tool_calls": [
                                {"name": "lookup_build", "args": {"build_id": "nightly-7"}}
                            ]
                        },
                        {"text": "ISO weeks are counted from 0."},
                    ],
                ),
                tools=["lookup_build"],
            ),
            Step(name="summarize", prompt=scripted("Summarize.", {"text": "Count from 1."})),
        ]

        results = await agent_workflow(workflow_id, steps, settings)
        for r in results:
            calls = ", ".join(f"{c.name}({json.dumps(c.args)})" for c in r.tool_calls)
            print(f"{r.step:12s} {r.text!r}  tools: {calls or '-'}")
            print(f"{'':12s} stored under result key {result_key(workflow_id, r.step)}")

        store = ChatStateStore().get_store()  # the default store the workflow used
        cp = await store.checkpoints.get(workflow_id)
        assert cp is not None
        print(f"checkpoint: chat {cp.chat_id}, cursor {cp.last_seen_message_id}")
        before = len(emu.messages(cp.chat_id))

        again = await agent_workflow(workflow_id, steps, settings)
        print(
            f"re-run: identical={again == results}, new messages: "
            f"{len(emu.messages(cp.chat_id)) - before}, archived: {emu.chat(cp.chat_id)['archived']}"
        )

        slow = Step(
            name="slow",
            prompt=scripted("Take your time.", {"text": "z " * 20, "deltas": 20, "delay": 0.2}),
        )
        timed_out = f"{workflow_id}-timeout"
        try:
            await agent_workflow(
                timed_out,
                [slow],
                settings.model_copy(update={"turn_timeout_s": 1, "keep_chat": True}),
            )
        except TimeoutError:
            cp = await store.checkpoints.get(timed_out)
            print(f"timed out after 1 s; the chat it created is checkpointed: {cp and cp.chat_id}")
        await store.aclose()


if __name__ == "__main__":
    asyncio.run(main())

"""coder_chat quick start: one chat, two turns, a client tool, a structured answer.

    .venv/bin/python examples/client_quickstart.py

(the project's virtualenv: ``scripts/demo`` or ``scripts/test`` creates it; a plain
``python`` stops with that hint). Talks to the deployment in CODER_URL / CODER_SESSION_TOKEN / CODER_ORG_ID when
those are set; otherwise starts the local chatd emulator in-process (its scripted
model echoes prompts and obeys ``#emu {...}`` directives).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator

from _example_env import require_project

require_project(__file__)

from pydantic import BaseModel  # noqa: E402

from coder_chat import (  # noqa: E402
    CoderAgent,
    CoderApiError,
    CoderChatError,
    ToolContext,
    client_tool,
    structured_output,
)


class Add(BaseModel):
    a: int
    b: int


@client_tool(description="Add two integers")
async def add(args: Add, ctx: ToolContext) -> int:
    # ctx.chat_id / ctx.tool_call_id identify this call (ledger / idempotency key)
    return args.a + args.b


class Verdict(BaseModel):
    ok: bool
    reason: str


verdict = structured_output(Verdict)


@contextlib.asynccontextmanager
async def deployment() -> AsyncIterator[dict[str, str]]:
    if os.environ.get("CODER_URL"):
        yield {}  # CoderAgent reads CODER_* itself
        return
    from coder_chat.emulator.server import Emulator

    async with Emulator() as emu:
        yield {
            "base_url": emu.base_url,
            "token": emu.token,
            "organization_id": emu.organization_id,
        }


def scripted(script: dict[str, object]) -> str:
    """Emulator-only: make the scripted model call tools (ignored by a real model)."""
    return "" if os.environ.get("CODER_URL") else " #emu " + json.dumps(script)


async def main() -> None:
    async with deployment() as creds:
        agent = CoderAgent(
            **creds,
            tools=[add, verdict],
            system_prompt="You are terse.",
            labels={"example": "quickstart"},
            request_timeout=300,  # per segment; always set one
        )
        try:
            first = await agent.generate("Say hello.", timeout=600)
            print("turn 1:", first.text, "| tokens out:", first.usage.output_tokens)

            add_call = {
                "steps": [
                    {"parts": [{"type": "client_tool", "name": "add", "args": {"a": 2, "b": 3}}]}
                ]
            }
            second = await agent.generate("Use the add tool on 2 and 3." + scripted(add_call))
            print(
                "turn 2:",
                second.text,
                "| tool calls:",
                [(c.tool_name, c.output) for c in second.client_tool_calls],
            )

            answer_call = {
                "steps": [
                    {
                        "parts": [
                            {
                                "type": "client_tool",
                                "name": "structured_output",
                                "args": {"ok": True, "reason": "2+3=5"},
                            }
                        ]
                    },
                    {"parts": [{"type": "text", "text": "Filed."}]},
                ]
            }
            got = await agent.generate_structured(
                verdict, "File your verdict." + scripted(answer_call)
            )
            print("verdict:", got.value)

            # checkpoint these two between durable steps (never the token)
            print("resume with:", agent.chat_id, agent.last_seen_message_id)
        except CoderChatError as exc:
            print("turn failed:", exc.kind, exc.retryable, exc)
        except CoderApiError as exc:
            print("HTTP error:", exc.status, exc)
        finally:
            with contextlib.suppress(CoderApiError):
                await agent.archive()  # end of the workflow only: archived chats cannot resume
            await agent.aclose()


if __name__ == "__main__":
    asyncio.run(main())

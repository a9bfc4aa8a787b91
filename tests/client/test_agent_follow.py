"""CoderAgent.follow(): re-attach to a chat's live turn without sending anything.

Real emulator, real sockets. The crash is a real ``kill -9`` of a process that
was running ``generate()``; a fresh agent with the checkpointed cursor follows
the turn to its end and returns what the dead process would have returned.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat import AgentTimings, CoderAgent, CoderAgentError, StreamOptions, ToolContext
from coder_chat import client_tool as make_tool
from coder_chat.agent import NoTurnToFollowError
from coder_chat.emulator.script import Script, ScriptStep, Sleep, Text
from coder_chat.emulator.server import Emulator

FAST = StreamOptions(backoff_initial_ms=20, backoff_cap_ms=80)
TIMINGS = AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05)

pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)


@pytest.fixture
def emu(chatd_emulator: Emulator) -> Emulator:
    return chatd_emulator


class Add(BaseModel):
    a: int
    b: int


def counting_add(ran: list[str]) -> Any:
    @make_tool(name="add", description="Add two integers")
    async def add(args: Add, ctx: ToolContext) -> int:
        ran.append(ctx.tool_call_id)
        return args.a + args.b

    return add


def make(emu: Emulator, **kw: Any) -> CoderAgent:
    kw.setdefault("stream_options", FAST)
    kw.setdefault("timings", TIMINGS)
    kw.setdefault("request_timeout", 10)
    return CoderAgent(
        base_url=emu.base_url, token=emu.token, organization_id=emu.organization_id, **kw
    )


def directive(script: Script, text: str = "go") -> str:
    return f"{text} #emu {json.dumps(script.to_json())}"


def users(emu: Emulator, chat_id: str) -> list[dict[str, Any]]:
    return [m for m in emu.messages(chat_id, include_system=False) if m["role"] == "user"]


def posts(emu: Emulator, chat_id: str, suffix: str) -> list[dict[str, Any]]:
    return [
        e["details"]
        for e in emu.event_log(["request"])
        if e["chat_id"] == chat_id
        and e["details"]["method"] == "POST"
        and e["details"]["path"].endswith(suffix)
    ]


async def until(check: Any, within: float = 5.0) -> None:
    for _ in range(int(within / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


# A process that checkpoints after a warm-up turn, then runs a slow tool turn.
CHILD = """
import asyncio, json, sys
from pydantic import BaseModel
from coder_chat import CoderAgent, ToolContext, client_tool

class Add(BaseModel):
    a: int
    b: int

@client_tool(description="Add two integers")
async def add(args: Add, ctx: ToolContext) -> int:
    print("TOOL", flush=True)
    return args.a + args.b

async def main() -> None:
    base, token, org, prompt = sys.argv[1:5]
    agent = CoderAgent(base_url=base, token=token, organization_id=org, tools=[add],
                       request_timeout=30)
    await agent.generate("warm up")
    ckpt = {"chat_id": agent.chat_id, "cursor": agent.last_seen_message_id}
    print("CKPT", json.dumps(ckpt), flush=True)
    await agent.generate(prompt)
    print("DONE", flush=True)

asyncio.run(main())
"""


async def test_follow_after_kill_9_finishes_the_turn_once(emu: Emulator) -> None:
    slow = Script.client_tool(
        "add",
        {"a": 2, "b": 3},
        text="Let me add. ",
        then=ScriptStep((Text("The sum is 5."),)),
    )
    # Step 1 streams, sleeps (the crash lands here), then pauses for the client tool.
    first = slow.steps[0]
    slow = Script((ScriptStep((first.parts[0], Sleep(1.5), *first.parts[1:])), *slow.steps[1:]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        emu.base_url,
        emu.token,
        emu.organization_id,
        directive(slow, "add 2 and 3 [wf/2]"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.startswith(b"CKPT "), line
        ckpt = json.loads(line[5:])
        chat_id, cursor = ckpt["chat_id"], ckpt["cursor"]
        await until(lambda: len(users(emu, chat_id)) == 2)
        await emu.await_status(chat_id, "running")
    finally:
        proc.kill()  # SIGKILL: no interrupt, no cleanup, no checkpoint
        rest = await proc.communicate()
    assert b"TOOL" not in rest[0] and b"DONE" not in rest[0]
    assert emu.chat(chat_id)["status"] == "running"  # the run outlived its process

    ran: list[str] = []
    follower = make(emu, chat_id=chat_id, last_seen_message_id=cursor, tools=[counting_add(ran)])
    result = await follower.follow(timeout=15)
    await follower.aclose()

    prompts = users(emu, chat_id)
    assert len(prompts) == 2  # warm-up + the one prompt: follow() sent nothing
    assert result.user_message_id == prompts[1]["id"]
    assert len(ran) == 1 and len(posts(emu, chat_id, "/tool-results")) == 1
    assert posts(emu, chat_id, "/interrupt") == []
    # What the dead process's generate() would have returned:
    assert result.text == "The sum is 5." and result.finish_reason == "stop"
    assert [s.text for s in result.steps] == ["Let me add. ", "The sum is 5."]
    (call,) = result.client_tool_calls
    assert (call.tool_name, call.input, call.output, call.step) == ("add", {"a": 2, "b": 3}, 5, 1)
    assert result.usage.output_tokens and result.chat_id == chat_id
    assert follower.last_seen_message_id == max(result.message_ids)
    assert emu.chat(chat_id)["status"] == "waiting"


async def test_follow_answers_a_pause_left_by_a_process_that_died_mid_tool(
    emu: Emulator,
) -> None:
    started = asyncio.Event()

    @make_tool(name="add", description="Add two integers")
    async def hangs(args: Add, ctx: ToolContext) -> int:
        started.set()
        await asyncio.Event().wait()  # the process dies before the tool returns
        raise AssertionError("unreachable")

    dying = make(emu, tools=[hangs])
    script = Script.client_tool("add", {"a": 4, "b": 4}, text="Adding. ")
    task = asyncio.create_task(dying.generate(directive(script)))
    await asyncio.wait_for(started.wait(), 5)
    chat_id = dying.chat_id
    assert chat_id is not None
    task.cancel()  # cancelled mid-tool: the pause is kept (no interrupt)
    with pytest.raises(asyncio.CancelledError):
        await task
    await dying.aclose()
    assert emu.chat(chat_id)["status"] == "requires_action"

    ran: list[str] = []
    follower = make(emu, chat_id=chat_id, tools=[counting_add(ran)])  # no cursor checkpointed
    result = await follower.follow(timeout=10)
    await follower.aclose()
    assert len(ran) == 1 and len(users(emu, chat_id)) == 1
    assert [c.output for c in result.client_tool_calls] == [8]
    assert result.steps[0].text == "Adding. " and result.text.startswith("Results: add")
    assert result.finish_reason == "stop" and result.user_message_id == users(emu, chat_id)[0]["id"]
    assert posts(emu, chat_id, "/interrupt") == []


async def test_follow_a_settled_turn_returns_what_generate_returned(emu: Emulator) -> None:
    ran: list[str] = []
    agent = make(emu, tools=[counting_add(ran)])
    warm = await agent.generate("warm up [wf/1]")
    cursor = agent.last_seen_message_id
    script = Script.client_tool(
        "add", {"a": 1, "b": 1}, text="Adding. ", then=ScriptStep((Text("Two."),))
    )
    done = await agent.generate(directive(script, "add [wf/2]"))
    await agent.aclose()
    chat_id = done.chat_id
    before = len(emu.event_log(["request"]))

    follower = make(emu, chat_id=chat_id, last_seen_message_id=cursor, tools=[counting_add(ran)])
    again = await follower.follow()
    assert len(ran) == 1  # the tool round came from history, nothing was re-run
    for field in (
        "text",
        "finish_reason",
        "raw_status",
        "usage",
        "user_message_id",
        "message_ids",
        "client_tool_calls",
        "chat_id",
    ):
        assert getattr(again, field) == getattr(done, field), field
    assert [(s.text, s.finish_reason, s.usage) for s in again.steps] == [
        (s.text, s.finish_reason, s.usage) for s in done.steps
    ]
    # hints pick other turns; every follow only read
    assert (await follower.follow(marker="[wf/1]")).text == warm.text
    by_id = await follower.follow(user_message_id=done.user_message_id)
    assert by_id.message_ids == done.message_ids
    sent = [e for e in emu.event_log(["request"])[before:] if e["details"]["method"] != "GET"]
    assert sent == []
    await follower.aclose()


async def test_follow_errors_and_timeout(emu: Emulator) -> None:
    with pytest.raises(CoderAgentError, match="needs a chat_id"):
        await make(emu).follow()
    agent = make(emu)
    r = await agent.generate("hello")
    caught_up = make(emu, chat_id=r.chat_id, last_seen_message_id=agent.last_seen_message_id)
    with pytest.raises(NoTurnToFollowError) as nothing:
        await caught_up.follow()
    assert nothing.value.chat_id == r.chat_id and "after message" in str(nothing.value)
    with pytest.raises(NoTurnToFollowError):
        await caught_up.follow(marker="[never]")
    with pytest.raises(CoderAgentError):
        await caught_up.follow(user_message_id=0)
    await caught_up.aclose()

    # A follow that times out stops the run it adopted, as generate() would have.
    task = asyncio.create_task(agent.generate(directive(Script.long_running(5))))
    await until(lambda: len(users(emu, r.chat_id)) == 2)
    follower = make(emu, chat_id=r.chat_id, last_seen_message_id=r.message_ids[-1])
    with pytest.raises(TimeoutError):
        await follower.follow(timeout=1.0)
    await follower.aclose()  # waits for the best-effort interrupt
    assert len(posts(emu, r.chat_id, "/interrupt")) == 1
    partial = await task  # the original reader sees the interrupted run settle
    assert partial.finish_reason == "stop"
    await agent.aclose()


async def test_follow_mid_turn_rebuilds_the_finished_round_and_streams_the_rest(
    chatd_era: str, emu: Emulator, events: Any
) -> None:
    ran: list[str] = []
    dying = make(emu, tools=[counting_add(ran)])
    warm = await dying.generate("warm up")
    cursor = dying.last_seen_message_id
    script = Script.client_tool(
        "add",
        {"a": 20, "b": 22},
        text="Adding. ",
        then=ScriptStep((Text("The sum is "), Sleep(1.0), Text("42."))),
    )
    task = asyncio.create_task(dying.generate(directive(script, "add [wf/3]")))
    await until(lambda: len(posts(emu, warm.chat_id, "/tool-results")) == 1)
    # The process "dies" in step 2: its teardown interrupt is lost on the way.
    emu.faults.fail_rest(1, method="POST", path="/interrupt")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await dying.aclose()
    assert emu.chat(warm.chat_id)["status"] == "running"

    follower = make(
        emu,
        chat_id=warm.chat_id,
        last_seen_message_id=cursor,
        tools=[counting_add(ran)],
        on_transport_event=events,
    )
    result = await follower.follow(timeout=10)
    await follower.aclose()
    assert ran == [result.client_tool_calls[0].tool_call_id]  # the dead process's run only
    assert [s.text for s in result.steps] == ["Adding. ", "The sum is 42."]
    assert result.text == "The sum is 42." and result.steps[0].finish_reason == "tool-calls"
    assert result.client_tool_calls[0].output == 42
    assert len(users(emu, warm.chat_id)) == 2
    ops = [e.op for e in events.of("http:request")]
    assert ops == ["getMessages"]  # one history read; nothing sent
    settles = events.of("segment:settle")
    assert [(s.ending, s.finish_reason) for s in settles] == [("clean", "stop")]


# chatd_era: B1 matches the promoted prompt by content, B2/B3 by queued_message_id.
async def test_follow_a_prompt_a_dead_process_left_queued(
    emu: Emulator, events: Any, chatd_era: str
) -> None:
    assert emu.era == chatd_era
    release = asyncio.Event()

    @make_tool(name="hold", description="waits for the test")
    async def hold(args: Add, ctx: ToolContext) -> int:
        await release.wait()
        return 0

    busy = make(emu, tools=[hold])
    t1 = asyncio.create_task(busy.generate(directive(Script.client_tool("hold", {"a": 0, "b": 0}))))
    await until(lambda: busy.chat_id is not None)
    chat_id = busy.chat_id
    assert chat_id is not None
    await emu.await_status(chat_id, "requires_action")

    seen: list[str] = []
    dying = make(emu, chat_id=chat_id, on_transport_event=lambda e: seen.append(e.type))
    t2 = asyncio.create_task(dying.generate("step [wf/5]"))
    # Reading behind the gate (a cancel during the POST itself would interrupt).
    await until(lambda: "ws:open" in seen)
    assert any(e["kind"] == "queue" for e in emu.event_log())
    # The process dies with its prompt queued; its withdrawal never lands.
    emu.faults.fail_rest(1, method="DELETE", path="/queue/")
    t2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t2
    await dying.aclose()
    assert len(emu.chat(chat_id)["queue"]) == 1

    follower = make(emu, chat_id=chat_id, on_transport_event=events)
    following = asyncio.create_task(follower.follow(marker="[wf/5]", timeout=10))
    await until(lambda: bool(events.of("ws:open")))  # gated behind the queued entry
    release.set()
    first = await t1
    result = await following
    mine = [m for m in users(emu, chat_id) if "[wf/5]" in m["content"][0]["text"]]
    assert len(mine) == 1 and result.user_message_id == mine[0]["id"]
    assert result.text == "Echo: step [wf/5]"
    assert not set(result.message_ids) & set(first.message_ids)
    # history (no such prompt), then the queue: the follow waited behind the gate
    assert [e.op for e in events.of("http:request")] == ["getMessages", "getMessages"]
    for agent in (busy, follower):
        await agent.aclose()

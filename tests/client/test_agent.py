"""CoderAgent against the real emulator (real sockets): turns, resume, tools,
construction, single-flight, errors, transport events, cleanup."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat import (
    AgentTimings,
    ChatClient,
    CoderAgent,
    CoderAgentError,
    CoderApiError,
    CoderChatError,
    StreamOptions,
    ToolContext,
    client_tool,
    structured_output,
)
from coder_chat.emulator.script import Script, ScriptStep, ServerToolCall, Text
from coder_chat.emulator.server import Emulator

FAST = StreamOptions(backoff_initial_ms=20, backoff_cap_ms=80)
TIMINGS = AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05)


# The emulator runs on its own loop in another thread (the chatd_emulator fixture),
# like a real server: the client loop never shares work with it.
pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)


@pytest.fixture
def emu(chatd_emulator: Emulator) -> Emulator:
    return chatd_emulator


def make(emu: Emulator, **kw: Any) -> CoderAgent:
    kw.setdefault("stream_options", FAST)
    kw.setdefault("timings", TIMINGS)
    kw.setdefault("request_timeout", 10)
    return CoderAgent(
        base_url=emu.base_url, token=emu.token, organization_id=emu.organization_id, **kw
    )


class Add(BaseModel):
    a: int
    b: int


calls: list[tuple[str, str, int]] = []


@client_tool(description="Add two integers")
async def add(args: Add, ctx: ToolContext) -> int:
    calls.append((ctx.chat_id, ctx.tool_call_id, args.a + args.b))
    return args.a + args.b


@client_tool(description="Always fails")
async def broken(args: Add, ctx: ToolContext) -> int:
    raise RuntimeError("disk on fire")


def requests(emu: Emulator, chat_id: str, suffix: str) -> list[dict[str, Any]]:
    return [
        e["details"]
        for e in emu.event_log(["request"])
        if e["chat_id"] == chat_id and e["details"]["path"].endswith(suffix)
    ]


async def started(agent: CoderAgent) -> str:
    """Wait until a running turn has created its chat."""
    for _ in range(1000):
        if agent.chat_id is not None:
            return agent.chat_id
        await asyncio.sleep(0.005)
    raise AssertionError("the turn never created its chat")


def directive(script: Script, text: str = "go") -> str:
    return f"{text} #emu {json.dumps(script.to_json())}"


# ----------------------------------------------------------------------- basics


async def test_first_turn_creates_chat_and_returns_text_usage(emu: Emulator, events: Any) -> None:
    agent = make(
        emu,
        tools=[add],
        system_prompt="be brief",
        labels={"workflow": "wf-1"},
        on_transport_event=events,
    )
    assert agent.chat_id is None and agent.last_seen_message_id is None
    result = await agent.generate("hello there")
    assert result.text == "Echo: hello there"
    assert result.finish_reason == "stop" and result.raw_status == "waiting"
    assert result.usage.output_tokens and result.usage.input_tokens
    assert agent.chat_id == result.chat_id == agent.last_known_chat_id
    assert result.user_message_id is not None
    assert result.message_ids and min(result.message_ids) > result.user_message_id
    assert agent.last_seen_message_id == max(result.message_ids)
    info = emu.chat(result.chat_id)
    assert info["labels"] == {"workflow": "wf-1"}
    assert info["client_type"] == "api"
    assert info["dynamic_tools"] == ["add"]
    rows = emu.messages(result.chat_id)
    assert any(r["role"] == "system" and r["content"][0]["text"] == "be brief" for r in rows)
    types = events.types()
    assert types[0] == "segment:start" and types.count("segment:settle") == 1
    settle = events.of("segment:settle")[0]
    assert (settle.ending, settle.status, settle.finish_reason) == ("clean", "waiting", "stop")
    assert settle.reader is not None and settle.chat_id == result.chat_id
    assert [e.op for e in events.of("http:request")] == ["createChat"]
    await agent.aclose()


async def test_resume_seeds_cursor_and_attributes_only_its_own_turn(
    emu: Emulator, events: Any
) -> None:
    first = make(emu)
    r1 = await first.generate("one")
    await first.aclose()
    # a new process: only the chat id was checkpointed
    second = make(emu, chat_id=r1.chat_id, on_transport_event=events)
    r2 = await second.generate("two")
    assert r2.text == "Echo: two"
    assert r2.usage.output_tokens == r1.usage.output_tokens  # not the sum of both turns
    assert not set(r2.message_ids) & set(r1.message_ids)
    assert [e.op for e in events.of("http:request")] == ["getMessages", "createChatMessage"]
    cursor = second.last_seen_message_id
    await second.aclose()
    # with the checkpointed cursor no probe is needed
    events.events.clear()
    third = make(emu, chat_id=r1.chat_id, last_seen_message_id=cursor, on_transport_event=events)
    r3 = await third.generate("three")
    assert r3.text == "Echo: three"
    assert [e.op for e in events.of("http:request")] == ["createChatMessage"]
    await third.aclose()


def test_construction_validates_without_io() -> None:
    with pytest.raises(CoderAgentError, match="positive"):
        CoderAgent(base_url="http://x", token="t", chat_id="c", last_seen_message_id=0)
    with pytest.raises(CoderAgentError, match="positive"):
        CoderAgent(base_url="http://x", token="t", chat_id="c", last_seen_message_id=True)
    with pytest.raises(CoderAgentError, match="requires chat_id"):
        CoderAgent(base_url="http://x", token="t", last_seen_message_id=5)
    with pytest.raises(CoderAgentError, match="duplicate"):
        CoderAgent(base_url="http://x", token="t", tools=[add, add])
    agent = CoderAgent(
        base_url="http://127.0.0.1:9", token="t", chat_id="c", last_seen_message_id=7
    )
    assert agent.last_seen_message_id == 7 and agent.last_known_chat_id == "c"


def test_token_defaults_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODER_URL", raising=False)
    monkeypatch.delenv("CODER_SESSION_TOKEN", raising=False)
    with pytest.raises(CoderAgentError):
        CoderAgent()
    monkeypatch.setenv("CODER_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CODER_SESSION_TOKEN", "env-secret-token")
    monkeypatch.setenv("CODER_ORG_ID", "org-1")
    monkeypatch.setenv("CODER_REQUEST_TIMEOUT", "12.5")
    agent = CoderAgent()
    assert agent.client.base_url == "http://127.0.0.1:9"
    assert agent.client.organization_id == "org-1"
    assert "env-secret-token" not in repr(agent) + repr(agent.client)


async def test_single_flight(emu: Emulator) -> None:
    agent = make(emu)
    first = asyncio.create_task(agent.generate(directive(Script.long_running(0.3))))
    await asyncio.sleep(0.05)
    with pytest.raises(CoderAgentError, match="already running"):
        await agent.generate("again")
    assert (await first).text == "Finally done."
    with pytest.raises(CoderAgentError):
        await agent.generate("   ")
    await agent.aclose()


# ----------------------------------------------------------------------- tools


async def test_client_tool_loop_on_one_retained_stream(emu: Emulator, events: Any) -> None:
    calls.clear()
    agent = make(emu, tools=[add], on_transport_event=events)
    r = await agent.generate(
        directive(Script.client_tool("add", {"a": 2, "b": 3}, text="Let me add. "))
    )
    assert r.text == "Results: add → 5"
    assert r.steps[0].text == "Let me add. " and r.steps[0].finish_reason == "tool-calls"
    assert r.steps[0].raw_status == "requires_action"
    assert [(c.tool_name, c.input, c.output, c.is_error) for c in r.client_tool_calls] == [
        ("add", {"a": 2, "b": 3}, 5, False)
    ]
    assert calls == [(r.chat_id, r.client_tool_calls[0].tool_call_id, 5)]
    assert r.usage == r.steps[0].usage + r.steps[1].usage
    assert len(events.of("ws:dial")) == 1  # the resume segment re-attached
    settles = events.of("segment:settle")
    assert [(s.finish_reason, s.status) for s in settles] == [
        ("tool-calls", "requires_action"),
        ("stop", "waiting"),
    ]
    assert len({s.reader for s in settles}) == 1
    assert [e.op for e in events.of("http:request")] == ["createChat", "submitToolResults"]
    await agent.aclose()


async def test_invalid_tool_input_and_raising_tool_become_error_results(emu: Emulator) -> None:
    agent = make(emu, tools=[add, broken])
    r = await agent.generate(
        directive(
            Script.client_tools([("add", {"a": "not a number"}), ("broken", {"a": 1, "b": 2})])
        )
    )
    bad, boom = r.client_tool_calls
    assert bad.is_error and "Invalid tool input" in bad.output
    assert boom.is_error and "disk on fire" not in boom.output and "error id" in boom.output
    tool_rows = [m for m in emu.messages(r.chat_id) if m["role"] == "tool"]
    assert {p["tool_call_id"]: p["is_error"] for m in tool_rows for p in m["content"]} == {
        bad.tool_call_id: True,
        boom.tool_call_id: True,
    }
    assert r.finish_reason == "stop"
    await agent.aclose()


async def test_server_tools_are_reported_and_do_not_cut_text(emu: Emulator) -> None:
    agent = make(emu)
    script = Script.of(
        ScriptStep((Text("Looking. "), ServerToolCall("execute", {"cmd": "ls"}, {"out": "a.txt"}))),
        ScriptStep((Text("Found a.txt."),)),
    )
    r = await agent.generate(directive(script))
    assert r.text == "Looking. Found a.txt."
    assert [c.tool_name for c in r.server_tool_calls] == ["execute"]
    assert r.server_tool_results[0].result == {"out": "a.txt"}
    assert len(r.steps) == 1
    await agent.aclose()


async def test_structured_output_pick_and_nudge(emu: Emulator) -> None:
    class Answer(BaseModel):
        city: str
        population: int

    answer = structured_output(Answer)
    agent = make(emu, tools=[answer])
    got = await agent.generate_structured(
        answer, directive(Script.structured_output({"city": "Oslo", "population": 700000}))
    )
    assert got.value == Answer(city="Oslo", population=700000) and not got.nudged
    # an invalid filing then a plain reply: one nudge re-prompt
    emu.script_next_turn(agent.chat_id, Script.structured_output({"city": "Oslo"}))  # type: ignore[arg-type]
    emu.set_chat_script(agent.chat_id, None)  # type: ignore[arg-type]
    got2 = await agent.generate_structured(answer, "again")
    assert got2.nudged
    assert got2.value is None  # the default echo script never files an answer
    await agent.aclose()


async def test_max_steps_winds_down_the_pause(emu: Emulator) -> None:
    agent = make(emu, tools=[add], max_steps=1)
    r = await agent.generate(directive(Script.client_tool("add", {"a": 1, "b": 1})))
    assert r.finish_reason == "tool-calls" and len(r.steps) == 1
    await emu.await_status(r.chat_id, "waiting", 5)  # results submitted → run finished
    await agent.aclose()


# ----------------------------------------------------------------------- errors


async def test_server_error_event_raises_chat_error(emu: Emulator, events: Any) -> None:
    agent = make(emu, on_transport_event=events)
    with pytest.raises(CoderChatError) as info:
        await agent.generate(directive(Script.fatal("bad request to provider", kind="config")))
    err = info.value
    assert err.kind == "config" and not err.retryable and err.status_code == 400
    assert agent.chat_id is not None  # not discarded
    settle = events.of("segment:settle")[-1]
    assert settle.ending == "failure" and settle.error["name"] == "CoderChatError"
    assert settle.status == "error"
    # the chat stays usable
    assert (await agent.generate("after error")).text == "Echo: after error"
    await agent.aclose()


async def test_archived_unknown_and_bad_token(emu: Emulator) -> None:
    agent = make(emu)
    r = await agent.generate("x")
    await agent.archive()
    with pytest.raises(CoderApiError) as archived:
        await agent.generate("y")
    assert archived.value.status == 400 and "archived" in archived.value.message
    await agent.wait_background()
    assert (
        not [  # a rejected submission started nothing: nothing to interrupt
            e for e in emu.event_log(["request"]) if e["details"]["path"].endswith("/interrupt")
        ]
    )
    unknown = make(emu, chat_id="00000000-0000-4000-8000-000000000001")
    with pytest.raises(CoderApiError) as missing:
        await unknown.generate("z")
    assert missing.value.status == 404
    bad = CoderAgent(
        base_url=emu.base_url, token="wrong-token", organization_id=emu.organization_id
    )
    with pytest.raises(CoderApiError) as denied:
        await bad.generate("z")
    assert denied.value.status == 401
    assert bad.chat_id is None
    for a in (agent, unknown, bad):
        await a.aclose()
    assert r.chat_id


# ----------------------------------------------------------------------- cleanup


async def test_interrupt_archive_reset(emu: Emulator) -> None:
    agent = make(emu)
    assert await agent.interrupt() == type(await agent.interrupt())(False, None)
    assert (await agent.archive()).archived is False
    task = asyncio.create_task(agent.generate(directive(Script.long_running(5))))
    await started(agent)
    chat_id = agent.chat_id
    assert chat_id is not None
    await emu.await_status(chat_id, "running")
    other = make(emu, chat_id=chat_id)
    res = await other.interrupt()
    assert res.interrupted and res.chat_id == chat_id
    result = await task  # the interrupted run settles as waiting with partial text
    assert result.finish_reason == "stop"
    with pytest.raises(CoderApiError) as conflict:
        await other.interrupt()
    assert conflict.value.status == 409
    agent.reset_session()
    assert agent.chat_id is None and agent.last_known_chat_id == chat_id
    assert agent.stranded_chat_ids == []
    arch = await agent.archive()
    assert arch.archived and arch.chat_id == chat_id and arch.archived_chat_ids == [chat_id]
    assert agent.last_known_chat_id is None
    assert emu.chat(chat_id)["archived"] is True
    await agent.aclose()
    await other.aclose()


async def test_resume_points_the_session_at_another_chat(emu: Emulator) -> None:
    async with make(emu) as first, make(emu) as agent:
        elsewhere = (await first.generate("on another chat")).chat_id
        own = (await agent.generate("one")).chat_id
        assert own != elsewhere
        agent.resume(elsewhere)
        assert agent.chat_id == agent.last_known_chat_id == elsewhere
        second = await agent.generate("two")  # sent on the resumed chat, not a new one
        assert second.chat_id == elsewhere
        with pytest.raises(CoderAgentError):
            agent.resume("")
        with pytest.raises(CoderAgentError):
            agent.resume(elsewhere, last_seen_message_id=0)
    users = [m for m in emu.messages(elsewhere, include_system=False) if m["role"] == "user"]
    assert len(users) == 2


async def test_archive_stops_a_live_run_then_archives(emu: Emulator) -> None:
    agent = make(emu)
    task = asyncio.create_task(agent.generate(directive(Script.long_running(5))))
    chat_id = await started(agent)
    await emu.await_status(chat_id, "running")
    other = make(emu, chat_id=chat_id)
    res = await other.archive()  # a live run: interrupted, then archived
    assert res.archived and res.archived_chat_ids == [chat_id]
    assert len(requests(emu, chat_id, "/interrupt")) == 1
    patches = [r for r in requests(emu, chat_id, chat_id) if r["method"] == "PATCH"]
    assert patches[-1]["status"] == 204
    partial = await task  # the interrupted run settled with its partial output
    assert partial.finish_reason == "stop" and partial.text != "Finally done."
    assert emu.chat(chat_id)["archived"] is True
    for a in (agent, other):
        await a.aclose()


async def test_archive_interrupts_a_paused_chat_twice(emu: Emulator) -> None:
    started_tool = asyncio.Event()

    @client_tool(name="add", description="never returns")
    async def hangs(args: Add, ctx: ToolContext) -> int:
        started_tool.set()
        await asyncio.Event().wait()
        return 0

    agent = make(emu, tools=[hangs])
    task = asyncio.create_task(
        agent.generate(directive(Script.client_tool("add", {"a": 1, "b": 1})))
    )
    await asyncio.wait_for(started_tool.wait(), 5)
    chat_id = agent.chat_id
    assert chat_id is not None
    task.cancel()  # the pause stays: requires_action
    with pytest.raises(asyncio.CancelledError):
        await task
    assert emu.chat(chat_id)["status"] == "requires_action"
    # One interrupt would only close the pending call and revive the run.
    res = await make(emu, chat_id=chat_id).archive()
    assert res.archived and len(requests(emu, chat_id, "/interrupt")) == 2
    assert emu.chat(chat_id)["archived"] is True
    await agent.aclose()


@pytest.mark.chatd_emulator(delta_delay=0.0005, interrupt_wind_down=1.0)
async def test_archive_window_too_short_raises_archive_incomplete(emu: Emulator) -> None:
    short = make(emu, timings=AgentTimings(settle_deadline=0.2, settle_retry_delay=0.05))
    task = asyncio.create_task(short.generate(directive(Script.long_running(5))))
    chat_id = await started(short)
    await emu.await_status(chat_id, "running")
    with pytest.raises(CoderChatError) as incomplete:
        await make(emu, chat_id=chat_id, timings=short._timings).archive()
    assert incomplete.value.kind == "archive_incomplete" and incomplete.value.retryable
    assert emu.chat(chat_id)["archived"] is False
    await task  # the interrupt winds down after the window; the turn settles
    await short.aclose()


async def test_prebuilt_client_events_split(emu: Emulator, events: Any) -> None:
    seen: list[str] = []
    async with ChatClient(
        emu.base_url,
        emu.token,
        organization_id=emu.organization_id,
        on_transport_event=lambda e: seen.append(e.type),
    ) as client:
        agent = CoderAgent(client=client, on_transport_event=events, timings=TIMINGS)
        await agent.generate("hi")
        await agent.aclose()
        assert not client.closed  # not owned by the agent
    assert set(events.types()) == {"segment:start", "segment:settle"}
    assert "http:request" in seen and "ws:open" in seen


async def test_aclose_mid_turn_is_a_teardown(emu: Emulator, events: Any) -> None:
    agent = make(emu, on_transport_event=events)
    task = asyncio.create_task(agent.generate(directive(Script.long_running(5))))
    chat_id = await started(agent)
    await emu.await_status(chat_id, "running")
    await asyncio.sleep(0.05)
    await agent.aclose()
    with pytest.raises(CoderAgentError, match="torn down"):
        await task
    settle = events.of("segment:settle")[-1]
    assert settle.ending == "teardown" and settle.error is None and settle.finish_reason is None
    assert len(events.of("segment:start")) == len(events.of("segment:settle")) == 1
    await emu.await_status(chat_id, "waiting", 3)  # its run was interrupted


async def test_transport_handler_exceptions_are_swallowed(emu: Emulator) -> None:
    def bad_handler(event: Any) -> None:
        raise RuntimeError("observer bug")

    async def bad_async_handler(event: Any) -> None:
        raise RuntimeError("async observer bug")

    for handler in (bad_handler, bad_async_handler):
        agent = make(emu, on_transport_event=handler)
        assert (await agent.generate("still fine")).text == "Echo: still fine"
        await agent.aclose()

"""Client tools: schema, validation, error outcomes, decorator, wrap, structured output."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat.errors import ToolBookkeepingError
from coder_chat.tools import (
    ClientTool,
    ToolContext,
    ToolError,
    client_tool,
    pick_structured,
    structured_output,
    tool_definitions,
    tools_by_name,
)

CTX = ToolContext(tool_call_id="call-1", chat_id="chat-1", tool_name="add")


class Add(BaseModel):
    a: int
    b: int


@client_tool(description="Add two integers")
async def add(args: Add, ctx: ToolContext) -> dict[str, Any]:
    return {"sum": args.a + args.b, "key": ctx.idempotency_key}


@client_tool()  # type: ignore[arg-type]
async def boom(args: Add) -> int:
    """Always fails."""
    raise RuntimeError("kaput")


async def test_definition_carries_input_schema() -> None:
    d = add.definition()
    assert d["name"] == "add" and d["description"] == "Add two integers"
    assert d["input_schema"]["properties"]["a"]["type"] == "integer"
    assert boom.description == "Always fails."


async def test_valid_input_runs_with_context() -> None:
    out = await add.run('{"a": 2, "b": 3}', CTX)
    assert not out.is_error
    assert out.output == {"sum": 5, "key": "chat-1/call-1"}
    assert out.input == Add(a=2, b=3)
    assert (await add.run({"a": 1, "b": 1}, CTX)).output["sum"] == 2


@pytest.mark.parametrize("raw", ['{"a": "x", "b": 1}', "not json", "{}", "null"])
async def test_invalid_input_becomes_error_result(raw: str) -> None:
    out = await add.run(raw, CTX)
    assert out.is_error and isinstance(out.output, str)
    assert out.output.startswith("Invalid tool input")


async def test_raising_tool_becomes_error_result() -> None:
    out = await boom.run('{"a": 1, "b": 2}', CTX)
    assert out.is_error and "kaput" not in out.output and "error id" in out.output


SECRET_URL = "postgresql://user:pw@db.internal:5432/coder_state"


@client_tool()
async def leaky(args: Add, ctx: ToolContext) -> int:
    """Fails with internal text in its exception."""
    raise RuntimeError(f"{SECRET_URL}: INSERT INTO coder_state_tool_ledger failed")


async def test_internal_exception_text_never_reaches_the_result_but_the_log_has_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="coder_chat.tools")
    out = await leaky.run('{"a": 1, "b": 2}', CTX)
    assert out.is_error
    for leak in (SECRET_URL, "pw@", "db.internal", "INSERT", "RuntimeError"):
        assert leak not in out.output
    found = re.search(r"error id (tool-err-[0-9a-f]{8})", out.output)
    assert found is not None
    # the run's log explains the result: the same id, the exception and its traceback
    (record,) = [r for r in caplog.records if found.group(1) in r.getMessage()]
    assert record.name == "coder_chat.tools" and record.exc_info is not None
    assert SECRET_URL in str(record.exc_info[1])
    again = await leaky.run('{"a": 1, "b": 2}', CTX)
    assert found.group(1) not in again.output  # one id per failure


async def test_tool_error_message_is_meant_for_the_model() -> None:
    @client_tool()
    async def declined(args: Add, ctx: ToolContext) -> int:
        raise ToolError("card declined: insufficient funds")

    out = await declined.run('{"a": 1, "b": 2}', CTX)
    assert out.is_error and out.output == "Tool failed: card declined: insufficient funds"


async def test_bookkeeping_error_is_not_a_tool_result() -> None:
    @client_tool()
    async def ledger_down(args: Add, ctx: ToolContext) -> int:
        raise ToolBookkeepingError("ledger_down", ctx.tool_call_id, "complete")

    with pytest.raises(ToolBookkeepingError) as info:
        await ledger_down.run('{"a": 1, "b": 2}', CTX)
    assert info.value.retryable and info.value.kind == "tool_bookkeeping"


async def test_non_json_output_is_stringified_and_models_dumped() -> None:
    class Out(BaseModel):
        x: int

    async def f(args: Add, ctx: ToolContext) -> Any:
        return Out(x=args.a) if args.a else object()

    tool = ClientTool("f", "", Add, f)
    assert (await tool.run('{"a":1,"b":0}', CTX)).output == {"x": 1}
    assert isinstance((await tool.run('{"a":0,"b":0}', CTX)).output, str)


async def test_wrap_keeps_name_and_schema_and_sees_context() -> None:
    seen: list[str] = []

    async def ledger(inner: ClientTool[Add], value: Add, ctx: ToolContext) -> Any:
        seen.append(ctx.idempotency_key)
        return await inner.fn(value, ctx)

    wrapped = add.wrap(ledger)
    assert wrapped.definition() == add.definition()
    out = await wrapped.run('{"a": 1, "b": 1}', CTX)
    assert out.output["sum"] == 2 and seen == ["chat-1/call-1"]


def test_bad_declarations() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        tool_definitions([add, add])
    with pytest.raises(TypeError):
        client_tool()(lambda a, c: None)  # type: ignore[arg-type,return-value]

    async def untyped(args, ctx):  # type: ignore[no-untyped-def]
        return 1

    with pytest.raises(TypeError):
        client_tool()(untyped)
    with pytest.raises(TypeError):
        ClientTool("x", "", dict, untyped)  # type: ignore[type-var]
    assert set(tools_by_name([add, boom])) == {"add", "boom"}


class Answer(BaseModel):
    city: str
    population: int


async def test_structured_output_tool_and_pick() -> None:
    so = structured_output(Answer)
    assert so.name == "structured_output"
    assert so.definition()["input_schema"]["required"] == ["city", "population"]
    ack = await so.run('{"city": "Oslo", "population": 700000}', CTX)
    assert not ack.is_error and isinstance(ack.output, str)
    bad = await so.run('{"city": "Oslo"}', CTX)
    assert bad.is_error
    # last validating call wins; a later invalid re-file does not shadow it
    inputs = [
        '{"city": "A", "population": 1}',
        '{"city": "B", "population": 2}',
        '{"city": "C"}',
        {"city": "D"},
    ]
    assert pick_structured(Answer, inputs) == Answer(city="B", population=2)
    assert pick_structured(Answer, ['{"city": 1}']) is None
    assert so.pick_from_inputs([{"city": "E", "population": 5}]) == Answer(city="E", population=5)


def test_tools_is_a_leaf_module() -> None:
    """tools.py imports nothing of coder_chat (not even under TYPE_CHECKING): the agent
    depends on tools, never the other way round."""
    import ast
    from pathlib import Path

    import coder_chat.tools

    tree = ast.parse(Path(coder_chat.tools.__file__).read_text())
    imported = {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not {m for m in imported if m.startswith("coder_chat")}, imported

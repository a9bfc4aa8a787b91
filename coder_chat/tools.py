"""Client tools: functions the model calls that run in *this* process.

A :class:`ClientTool` is a name, a description, a pydantic input model (its
JSON schema is declared to chatd at chat creation as ``input_schema``) and an
async callable ``fn(input, ctx)``. The agent validates the model's raw JSON
arguments against the input model and hands the callable a
:class:`ToolContext` (chat id + tool call id). Invalid arguments and
exceptions raised by the callable become ``is_error`` results the model sees;
they never fail the turn — with one exception, below.

What the model (and the Coder server, which stores every tool result) sees of a
failure: invalid arguments verbatim (the model needs them to fix its call); a
:class:`ToolError`'s message verbatim (the tool author wrote it for the model);
for any other exception only "the tool failed" and a short error id — the
exception itself (which may carry SQL, file paths, hosts, URLs with passwords)
is logged under that id on the ``coder_chat.tools`` logger, so the run's log
explains the result. A :class:`~coder_chat.errors.ToolBookkeepingError` (a
crash-safe tool's ledger write failed around its effect) is never turned into a
result: it fails the turn with the pause unanswered, for recovery to finish the
call under the same idempotency key.

The context carries exactly what a crash-safe wrapper needs to build a
write-ahead ledger key and an idempotency key (``ctx.chat_id`` +
``ctx.tool_call_id``), so such a wrapper can be written as an ordinary
:class:`ClientTool` around another one (see :meth:`ClientTool.wrap`) without
changing the agent.

``structured_output(Model)`` registers the ``structured_output`` tool pattern
(agent-semantics §9): the model files its answer as that tool's input; after
the turn the last *validating* call wins. Running a turn and nudging once is
the agent's job (:meth:`coder_chat.agent.CoderAgent.generate_structured`):
this module is a leaf and imports nothing of the agent.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, get_type_hints

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

_log = logging.getLogger(__name__)

STRUCTURED_OUTPUT_TOOL = "structured_output"
STRUCTURED_OUTPUT_ACK = "Answer recorded. Finish your reply briefly without calling more tools."
STRUCTURED_OUTPUT_NUDGE = (
    "You did not file a valid answer. Call the `structured_output` tool exactly once "
    "with an input that matches its schema."
)


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool execution knows about where it runs.

    ``(chat_id, tool_call_id)`` is unique per call and stable across process
    restarts (chatd assigns the call id), which makes it the natural ledger /
    idempotency key for effectful tools.
    """

    tool_call_id: str
    chat_id: str
    tool_name: str
    #: The write-ahead ledger's key when the tool runs behind one
    #: (:func:`coder_chat.crash_safe.ledgered`): tenant, chat and call.
    ledger_key: str | None = None

    @property
    def idempotency_key(self) -> str:
        """The key to hand effects that accept one: the ledger's key when the tool
        runs behind the write-ahead ledger (the same key on a re-drive after a
        crash), else ``"<chat_id>/<tool_call_id>"``."""
        return self.ledger_key or f"{self.chat_id}/{self.tool_call_id}"


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """The result of one client tool execution, as posted to ``/tool-results``."""

    tool_call_id: str
    tool_name: str
    output: Any
    is_error: bool = False
    #: The validated input (``None`` when validation failed).
    input: Any = None
    #: For a tool that raised: its exception type and error id (``"RuntimeError
    #: [tool-err-1a2b3c4d]"``), what a run's log may show — never the message.
    error: str | None = None


ToolFn = Callable[[Any, ToolContext], Awaitable[Any]]


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


class ToolError(Exception):
    """Raise from a client tool to tell the model why it failed, in your words.

    The message is sent to the Coder server as the tool's ``is_error`` result,
    verbatim: write it for the model ("card declined: insufficient funds", "no
    such branch 'mian'"), never with secrets or internal detail. Any other
    exception reaches the model only as "the tool failed" plus an error id (see
    :func:`failure_text`). A crash-safe tool's effect raising it leaves the
    ledger entry ``committing`` like any exception (the effect's outcome is the
    tool's to judge; a repeat of the call is re-driven under the same key).
    """


def fails_turn(exc: BaseException) -> bool:
    """Whether a tool's exception must fail the turn instead of becoming a result:
    it says so with a true ``fails_turn`` attribute
    (:class:`~coder_chat.errors.ToolBookkeepingError` does; this module imports
    nothing of ``coder_chat``, so it asks the exception)."""
    return getattr(exc, "fails_turn", False) is True


def _invalid_input_text(exc: ValidationError) -> str:
    issues = "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or '<root>'}: {err['msg']}"
        for err in exc.errors(include_url=False)
    )
    return f"Invalid tool input: {issues}"


def failure_text(exc: Exception, tool_name: str, tool_call_id: str) -> tuple[str, str]:
    """The ``is_error`` output for a tool that raised ``exc``, and what a run's log may
    show of it (:attr:`ToolOutcome.error`: the type and the error id).

    A :class:`ToolError` is the author's message for the model. Anything else may
    carry internal text (SQL, paths, hosts, credentials in URLs) that must reach
    neither the Coder server nor the model: the result says the tool failed and
    gives a short error id; the exception is logged (``coder_chat.tools``, ERROR,
    with its traceback) under that id.
    """
    if isinstance(exc, ToolError):
        return f"Tool failed: {exc}", "ToolError"
    error_id = f"tool-err-{secrets.token_hex(4)}"
    _log.error(
        "client tool %s (call %s) raised %s [error id %s]",
        tool_name,
        tool_call_id,
        type(exc).__name__,
        error_id,
        exc_info=exc,
    )
    return (
        f"Tool failed with an internal error (error id {error_id}). "
        "The details are in the run's log under that id."
    ), f"{type(exc).__name__} [{error_id}]"


class ClientTool(Generic[M]):
    """A tool the model may call and this process executes.

    Args:
        name: tool name as the model sees it (unique per chat).
        description: what the tool does, for the model.
        input_model: pydantic model of the arguments; its JSON schema is sent.
        fn: ``async fn(input: input_model, ctx: ToolContext) -> JSON-able``.
    """

    def __init__(
        self,
        name: str,
        description: str,
        input_model: type[M],
        fn: Callable[[M, ToolContext], Awaitable[Any]],
    ) -> None:
        if not name:
            raise ValueError("tool name must not be empty")
        if not (isinstance(input_model, type) and issubclass(input_model, BaseModel)):
            raise TypeError("input_model must be a pydantic BaseModel subclass")
        self.name = name
        self.description = description
        self.input_model = input_model
        self.fn = fn

    def __repr__(self) -> str:
        return f"ClientTool(name={self.name!r}, input_model={self.input_model.__name__})"

    def input_schema(self) -> dict[str, Any]:
        """JSON Schema of the input model (sent as ``input_schema``)."""
        return self.input_model.model_json_schema()

    def definition(self) -> dict[str, Any]:
        """The ``unsafe_dynamic_tools`` entry for chat creation."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema(),
        }

    def parse_input(self, raw_args: Any) -> M:
        """Validate raw arguments (a JSON string or an already-decoded value)."""
        if isinstance(raw_args, str | bytes):
            return self.input_model.model_validate_json(raw_args or "{}")
        return self.input_model.model_validate({} if raw_args is None else raw_args)

    async def run(self, raw_args: Any, ctx: ToolContext) -> ToolOutcome:
        """Validate and execute; a failure becomes an ``is_error`` outcome.

        Invalid arguments are described to the model; a :class:`ToolError`'s
        message is passed on; any other exception becomes "the tool failed" with
        an error id (:func:`failure_text`). Raises what :func:`fails_turn` names
        (:class:`~coder_chat.errors.ToolBookkeepingError`): the tool's outcome must
        not be decided by a failed ledger write — the turn fails, the pause stays.
        """
        try:
            value = self.parse_input(raw_args)
        except ValidationError as exc:
            return ToolOutcome(ctx.tool_call_id, self.name, _invalid_input_text(exc), True)
        try:
            output = await self.fn(value, ctx)
        except Exception as exc:  # a tool bug is the model's problem to route around
            if fails_turn(exc):
                raise
            text, error = failure_text(exc, self.name, ctx.tool_call_id)
            return ToolOutcome(ctx.tool_call_id, self.name, text, True, value, error)
        return ToolOutcome(ctx.tool_call_id, self.name, _jsonable(output), False, value)

    def wrap(
        self,
        middleware: Callable[[ClientTool[M], M, ToolContext], Awaitable[Any]],
    ) -> ClientTool[M]:
        """A tool with the same name/schema whose execution goes through ``middleware``.

        ``middleware(inner_tool, input, ctx)`` decides whether and how to call
        ``inner_tool.fn`` (e.g. a write-ahead ledger that skips the effect when a
        ``done`` entry exists for ``ctx.idempotency_key``).
        """
        inner = self

        async def fn(value: M, ctx: ToolContext) -> Any:
            return await middleware(inner, value, ctx)

        return ClientTool(self.name, self.description, self.input_model, fn)


def client_tool(
    name: str | None = None, description: str | None = None
) -> Callable[[Callable[[Any, ToolContext], Awaitable[Any]]], ClientTool[Any]]:
    """Decorator form: the input model is the annotation of the first parameter.

    >>> class Add(BaseModel):
    ...     a: int
    ...     b: int
    >>> @client_tool(description="Add two numbers")
    ... async def add(args: Add, ctx: ToolContext) -> int:
    ...     return args.a + args.b
    """

    def decorate(fn: Callable[[Any, ToolContext], Awaitable[Any]]) -> ClientTool[Any]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError("client tools must be async functions")
        params = list(inspect.signature(fn).parameters.values())
        if not params:
            raise TypeError("a client tool takes (input: Model, ctx: ToolContext)")
        hints = get_type_hints(fn)
        model = hints.get(params[0].name)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError("annotate the first parameter with a pydantic model")
        takes_ctx = len(params) >= 2

        async def call(value: Any, ctx: ToolContext) -> Any:
            return await (fn(value, ctx) if takes_ctx else fn(value))  # type: ignore[call-arg]

        desc = description if description is not None else inspect.getdoc(fn) or ""
        return ClientTool(name or fn.__name__, desc, model, call)

    return decorate


def tool_definitions(tools: Iterable[ClientTool[Any]]) -> list[dict[str, Any]]:
    """``unsafe_dynamic_tools`` for a tool list; rejects duplicate names."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"duplicate client tool name {tool.name!r}")
        seen.add(tool.name)
        out.append(tool.definition())
    return out


# --------------------------------------------------------------------------- structured output


def pick_structured(model: type[M], inputs: Iterable[Any]) -> M | None:
    """The last input (in call order) that validates against ``model``, else ``None``.

    Iterates from the last call backwards so a schema-invalid re-file never
    shadows an earlier valid answer.
    """
    for raw in reversed(list(inputs)):
        try:
            if isinstance(raw, str | bytes):
                return model.model_validate_json(raw)
            return model.model_validate(raw)
        except ValidationError:
            continue
    return None


class CallRecord(Protocol):
    """A client tool call as a turn result records it (``agent.ClientToolCall`` fits)."""

    @property
    def tool_name(self) -> str: ...
    @property
    def input(self) -> Any: ...


class HasClientCalls(Protocol):
    """A turn result with its client tool calls (``agent.GenerateResult`` fits)."""

    @property
    def client_tool_calls(self) -> Sequence[CallRecord]: ...


class StructuredOutput(ClientTool[M]):
    """The ``structured_output`` client tool; its input schema is the answer schema.

    Register it like any tool (``CoderAgent(tools=[answer])``). Execution only
    acknowledges; the answer is read after the turn with :meth:`pick`, or use
    :meth:`coder_chat.agent.CoderAgent.generate_structured`, which also nudges
    once when no valid answer was filed.
    """

    def __init__(
        self,
        model: type[M],
        *,
        name: str = STRUCTURED_OUTPUT_TOOL,
        description: str | None = None,
        ack: str = STRUCTURED_OUTPUT_ACK,
        nudge: str = STRUCTURED_OUTPUT_NUDGE,
    ) -> None:
        async def acknowledge(value: M, ctx: ToolContext) -> Any:
            return ack

        super().__init__(
            name,
            description
            or "File your final answer. The input is the answer; it must match the schema.",
            model,
            acknowledge,
        )
        self.model = model
        self.nudge = nudge

    def pick(self, result: HasClientCalls) -> M | None:
        """The last validating ``structured_output`` call across all steps of ``result``."""
        inputs = [c.input for c in result.client_tool_calls if c.tool_name == self.name]
        return pick_structured(self.model, inputs)

    def pick_from_inputs(self, inputs: Iterable[Any]) -> M | None:
        """As :meth:`pick`, for inputs recovered from history."""
        return pick_structured(self.model, inputs)


def structured_output(
    model: type[M], *, name: str = STRUCTURED_OUTPUT_TOOL, description: str | None = None
) -> StructuredOutput[M]:
    """Create the ``structured_output`` client tool for ``model`` (agent-semantics §9)."""
    return StructuredOutput(model, name=name, description=description)


def tools_by_name(tools: Iterable[ClientTool[Any]]) -> Mapping[str, ClientTool[Any]]:
    """Index tools by name (duplicates rejected)."""
    listed = list(tools)
    tool_definitions(listed)
    return {t.name: t for t in listed}

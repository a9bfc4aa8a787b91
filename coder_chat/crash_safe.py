"""Crash-safe client tools: a write-ahead ledger around effectful tools.

If the process dies *between* a non-idempotent client tool committing its
effect (a payment, a deploy, an email) and the result reaching the server, the
chat's ``requires_action`` pause is the only pending record of the execution.
Interrupt it away and the resubmitted prompt may call the tool again,
duplicating the effect. So an effectful tool goes through a ledger keyed by
tenant + chat id + tool call id (the server assigns the call id and commits it
to history, so both sides survive the crash):

1. ``committing`` is written BEFORE the effect — no entry proves the effect
   never started;
2. the ledger's key is handed to the external system as its idempotency key —
   re-driving can never double-apply;
3. ``done`` + output is written after — an effect with a stranded result is
   answered from the ledger, nothing re-executes.

If either write fails (the store restarted under the tool), the tool's outcome is
not reported at all: :class:`~coder_chat.errors.ToolBookkeepingError` fails the turn
with the pause unanswered, and recovery finishes the call under the same key.

Recovery (:mod:`coder_chat.recovery`) reconciles a ``requires_action`` pause
with the same ledger and calls :meth:`CrashSafeTool.redrive` for a
``committing`` entry.

Usage::

    class Charge(BaseModel):
        amount_cents: int

    @crash_safe_tool(description="Charge the customer's card.")
    async def charge_card(args: Charge, ctx: EffectContext) -> dict:
        receipt = await payments.charge(args.amount_cents, idempotency_key=ctx.idempotency_key)
        return {"receipt": receipt}

    agent = CoderAgent(..., tools=[charge_card.bind(store.ledger)])

A plain :class:`~coder_chat.tools.ClientTool` goes behind the same ledger with
:func:`ledgered` (its ``ctx.idempotency_key`` becomes the ledger key); durable
runners wrap every tool for which :func:`needs_ledger` holds, so tools are
crash-safe unless declared side-effect free with :func:`pure`.

``coder_chat`` imports no store: anything with the :class:`ToolLedgerStore`
shape works (``blocks.StateStore().ledger`` does).

Test seam: :func:`crash_point` marks named points (``tool.after_effect``,
``tool.after_done`` …) where a test installs a hook with
:func:`add_crash_hook` that SIGKILLs the process. Production installs no hook,
and a crash point is then a no-op.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, get_type_hints

from pydantic import BaseModel

from coder_chat.errors import CoderError, ToolBookkeepingError
from coder_chat.tools import ClientTool, StructuredOutput, ToolContext

__all__ = [
    "CrashSafeTool",
    "EffectContext",
    "LedgerEntryView",
    "PureTool",
    "ToolLedgerStore",
    "add_crash_hook",
    "crash_point",
    "crash_safe_tool",
    "ledgered",
    "needs_ledger",
    "pure",
]

M = TypeVar("M", bound=BaseModel)

_log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- crash points

CrashHook = Callable[[str], object]
_crash_hooks: list[CrashHook] = []


def add_crash_hook(hook: CrashHook) -> Callable[[], None]:
    """Install a test hook called with the name of every crash point reached.

    Returns a function that removes it. Test seam only: the crash-matrix tests
    install a hook that SIGKILLs the process at one named point.
    """
    _crash_hooks.append(hook)

    def remove() -> None:
        if hook in _crash_hooks:
            _crash_hooks.remove(hook)

    return remove


def crash_point(name: str) -> None:
    """A named point where a crash is interesting (no-op without a test hook)."""
    for hook in list(_crash_hooks):
        hook(name)


# --------------------------------------------------------------------------- ledger protocol


class LedgerEntryView(Protocol):
    """What the wrapper reads from a ledger entry (``blocks.LedgerEntry`` fits)."""

    @property
    def state(self) -> str: ...
    @property
    def output(self) -> Any: ...


class ToolLedgerStore(Protocol):
    """The tool ledger the wrapper writes (``blocks.StateStore().ledger`` fits)."""

    def idempotency_key(self, chat_id: str, tool_call_id: str) -> str: ...

    async def begin(
        self, chat_id: str, tool_call_id: str, *, tool_name: str | None = ..., args: Any = ...
    ) -> tuple[Any, bool]: ...

    async def complete(
        self,
        chat_id: str,
        tool_call_id: str,
        output: Any,
        *,
        tool_name: str | None = ...,
        args: Any = ...,
    ) -> Any: ...

    async def get(self, chat_id: str, tool_call_id: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class EffectContext:
    """What an effect knows: the call, and the key to hand the external system."""

    tool_call_id: str
    chat_id: str
    tool_name: str
    #: The ledger key (tenant/chat/call): pass it as the external idempotency key.
    idempotency_key: str


EffectFn = Callable[[Any, EffectContext], Awaitable[Any]]
BeforeEffect = Callable[[ToolContext], Awaitable[object]]


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    json.dumps(value)  # the ledger stores JSON: fail before the "done" write, loudly
    return value


class LedgerNotBoundError(CoderError, RuntimeError):
    """A crash-safe tool ran without a ledger (call :meth:`CrashSafeTool.bind`)."""


class CrashSafeTool(ClientTool[M]):
    """A client tool whose effect runs behind the write-ahead ledger.

    Args:
        name, description, input_model: as :class:`~coder_chat.tools.ClientTool`.
        effect: ``async effect(input, EffectContext) -> JSON-able``; must pass
            ``ctx.idempotency_key`` to the external system.
        ledger: the ledger (or bind one later with :meth:`bind`).
        before_effect: awaited before the write-ahead (e.g. make the chat id
            durable first, so a crash inside the effect leaves a findable chat).
        redrive: the re-drive path for an ambiguous ``committing`` entry
            (default: ``effect`` again, with the same key).
        match_earlier_attempts: ask the ledger to answer a call that repeats one an
            EARLIER attempt of the same step already applied (same tool, same
            arguments; count-based) with that call's recorded output instead of
            running the effect again under the new call id's key — and a call that
            repeats one whose effect never reported (its entry still ``committing``:
            the effect raised, or its ``done`` write failed) by re-driving the
            effect under THAT call's key. Needs a ledger whose ``begin`` takes
            ``match_earlier_attempts`` and ``in_flight`` (``blocks``' does; it
            scopes calls by the chat's send journal). Durable workflows turn it on
            (``prefect_coder.flows.common.toolset.bind_crash_safe``).

    A failed ledger write (the write-ahead, the ``done`` write, ``before_effect``)
    raises :class:`~coder_chat.errors.ToolBookkeepingError`, which fails the turn
    instead of becoming the tool's result: the effect may have run, and the model
    must not be told it failed (docs/durable-workflows.md, "When the ledger write
    fails").
    """

    def __init__(
        self,
        name: str,
        description: str,
        input_model: type[M],
        effect: Callable[[M, EffectContext], Awaitable[Any]],
        *,
        ledger: ToolLedgerStore | None = None,
        before_effect: BeforeEffect | None = None,
        redrive: Callable[[M, EffectContext], Awaitable[Any]] | None = None,
        match_earlier_attempts: bool = False,
    ) -> None:
        self.effect = effect
        self.ledger = ledger
        self.before_effect = before_effect
        self.match_earlier_attempts = match_earlier_attempts
        self._redrive = redrive or effect
        super().__init__(name, description, input_model, self._live)

    def __repr__(self) -> str:
        return f"CrashSafeTool(name={self.name!r}, input_model={self.input_model.__name__})"

    def bind(
        self,
        ledger: ToolLedgerStore,
        *,
        before_effect: BeforeEffect | None = None,
        match_earlier_attempts: bool | None = None,
    ) -> CrashSafeTool[M]:
        """A copy of this tool writing to ``ledger`` (per turn / per store)."""
        return CrashSafeTool(
            self.name,
            self.description,
            self.input_model,
            self.effect,
            ledger=ledger,
            before_effect=before_effect or self.before_effect,
            redrive=self._redrive,
            match_earlier_attempts=(
                self.match_earlier_attempts
                if match_earlier_attempts is None
                else match_earlier_attempts
            ),
        )

    def _require_ledger(self) -> ToolLedgerStore:
        if self.ledger is None:
            raise LedgerNotBoundError(
                f"crash-safe tool {self.name!r} has no ledger: use tool.bind(store.ledger)"
            )
        return self.ledger

    def _effect_ctx(self, ledger: ToolLedgerStore, ctx: ToolContext) -> EffectContext:
        return EffectContext(
            tool_call_id=ctx.tool_call_id,
            chat_id=ctx.chat_id,
            tool_name=self.name,
            idempotency_key=ledger.idempotency_key(ctx.chat_id, ctx.tool_call_id),
        )

    async def _live(self, value: M, ctx: ToolContext) -> Any:
        ledger = self._require_ledger()
        if self.before_effect is not None:
            async with _bookkeeping(self.name, ctx.tool_call_id, "before_effect"):
                await self.before_effect(ctx)
        args = value.model_dump(mode="json")
        with _running_calls(ctx.chat_id, ctx.tool_call_id) as running:
            # Passed only when asked for: a ledger of another shape need not know them.
            scoped: dict[str, Any] = (
                {
                    "match_earlier_attempts": True,
                    # An identical call of this round still running is another call.
                    # The LIVE set, read by the ledger when it matches (inside its
                    # transaction), never a copy taken now: a sibling that registers
                    # after this line but whose write-ahead commits before ours would
                    # otherwise look like an unreported repeat, and this call would be
                    # "re-driven" under the sibling's key — two calls, one effect.
                    "in_flight": running,
                }
                if self.match_earlier_attempts
                else {}
            )
            # Write-ahead, BEFORE the effect: no entry proves the effect never started.
            async with _bookkeeping(self.name, ctx.tool_call_id, "begin"):
                entry, created = await ledger.begin(
                    ctx.chat_id, ctx.tool_call_id, tool_name=self.name, args=args, **scoped
                )
            replay_of = getattr(entry, "replay_of", None)
            if entry.state == "done":
                if created and replay_of:
                    # A resubmitted attempt repeating an applied call under a NEW call
                    # id (a new key): the ledger answered it from the earlier record.
                    _log.info(
                        "crash-safe tool %s: call %s repeats call %s, which an earlier "
                        "attempt of this step already applied with the same arguments: "
                        "answered with its recorded output, the effect is not run again",
                        self.name,
                        ctx.tool_call_id,
                        replay_of,
                    )
                # A replayed call (e.g. a re-read pause) whose effect already committed.
                return entry.output
            if replay_of:
                # The call repeats one whose effect may have applied and never reported:
                # re-drive THAT call's key, never a fresh effect under ours.
                return await self._redrive_earlier(ledger, value, ctx, args, replay_of)
            # "committing" from an earlier crash, or ours: either way run the effect with
            # THE SAME key — a committed effect replays as a no-op at the external system.
            crash_point("tool.before_effect")
            output = _jsonable(await self.effect(value, self._effect_ctx(ledger, ctx)))
            crash_point("tool.after_effect")
            async with _bookkeeping(self.name, ctx.tool_call_id, "complete"):
                done = await ledger.complete(
                    ctx.chat_id, ctx.tool_call_id, output, tool_name=self.name, args=args
                )
            crash_point("tool.after_done")
            # The FIRST "done" wins: a racing re-drive's recorded outcome is the answer.
            return done.output

    async def _redrive_earlier(
        self,
        ledger: ToolLedgerStore,
        value: M,
        ctx: ToolContext,
        args: Any,
        earlier: str,
    ) -> Any:
        """Run the effect under ``earlier``'s key for the call ``ctx`` (which repeats
        it), record ``earlier`` done (if it was not) and the call done with the answer."""
        _log.warning(
            "crash-safe tool %s: call %s repeats call %s, whose effect may have applied "
            "without reporting (its ledger entry is not done, or was written by older "
            "code): re-driving under call %s's idempotency key, not a fresh effect",
            self.name,
            ctx.tool_call_id,
            earlier,
            earlier,
        )
        with _running_calls(ctx.chat_id, earlier):
            async with _bookkeeping(self.name, ctx.tool_call_id, "begin"):
                target = await ledger.get(ctx.chat_id, earlier)
            key_ctx = ToolContext(tool_call_id=earlier, chat_id=ctx.chat_id, tool_name=self.name)
            crash_point("tool.before_effect")
            output = _jsonable(await self._redrive(value, self._effect_ctx(ledger, key_ctx)))
            crash_point("tool.after_effect")
            async with _bookkeeping(self.name, ctx.tool_call_id, "complete"):
                if target is None or target.state != "done":
                    # The FIRST "done" of the earlier call wins, as on its own re-drive.
                    output = (await ledger.complete(ctx.chat_id, earlier, output)).output
                done = await ledger.complete(
                    ctx.chat_id, ctx.tool_call_id, output, tool_name=self.name, args=args
                )
            crash_point("tool.after_done")
            return done.output

    async def redrive(self, raw_args: Any, ctx: ToolContext) -> Any:
        """Re-drive an ambiguous ``committing`` call from recovery.

        ``raw_args`` come from history and are validated exactly as the live loop
        would (a ``ValidationError`` propagates: the live loop never reached the
        write-ahead with invalid arguments, so this cannot be the same call). The
        same idempotency key is used — the key of the earlier call this one
        repeats, if its entry names one (``replay_of``) — and the outcome is
        recorded ``done``. A failed ledger read or write raises
        :class:`~coder_chat.errors.ToolBookkeepingError`.
        """
        ledger = self._require_ledger()
        value = self.parse_input(raw_args)
        args = value.model_dump(mode="json")
        async with _bookkeeping(self.name, ctx.tool_call_id, "begin"):
            entry = await ledger.get(ctx.chat_id, ctx.tool_call_id)
        earlier = getattr(entry, "replay_of", None) if entry is not None else None
        if earlier:
            return await self._redrive_earlier(ledger, value, ctx, args, earlier)
        crash_point("tool.redrive.before_effect")
        output = _jsonable(await self._redrive(value, self._effect_ctx(ledger, ctx)))
        async with _bookkeeping(self.name, ctx.tool_call_id, "complete"):
            done = await ledger.complete(
                ctx.chat_id, ctx.tool_call_id, output, tool_name=self.name, args=args
            )
        return done.output


#: Call ids whose effect runs in this process right now, per chat: the ledger never
#: answers a call with a sibling of its own tool round that is still running.
_running: dict[str, set[str]] = {}


@contextlib.contextmanager
def _running_calls(chat_id: str, tool_call_id: str) -> Iterator[set[str]]:
    """Register the call as running on its chat; yields the chat's live set (it stays
    this chat's set for as long as the call is in it)."""
    calls = _running.setdefault(chat_id, set())
    added = tool_call_id not in calls
    calls.add(tool_call_id)
    try:
        yield calls
    finally:
        if added:
            calls.discard(tool_call_id)
            if not calls:
                _running.pop(chat_id, None)


@contextlib.asynccontextmanager
async def _bookkeeping(tool_name: str, tool_call_id: str, stage: str) -> AsyncIterator[None]:
    """A failed ledger write decides nothing about the tool's outcome: it fails the
    turn (retryable) with the pause unanswered, never as a "tool failed" result —
    the effect may have run, and the model would call it again under a new key.
    The store's exception text (SQL, hosts, paths) stays out of the message."""
    try:
        yield
    except (ToolBookkeepingError, LedgerNotBoundError):
        raise
    except Exception as exc:
        _log.error(
            "crash-safe tool %s (call %s): ledger %s failed (%s); the call stays "
            "unanswered for recovery to finish under the same idempotency key",
            tool_name,
            tool_call_id,
            stage,
            type(exc).__name__,
            exc_info=exc,
        )
        raise ToolBookkeepingError(tool_name, tool_call_id, stage) from exc


def crash_safe_tool(
    name: str | None = None,
    description: str | None = None,
    *,
    redrive: Callable[[Any, EffectContext], Awaitable[Any]] | None = None,
) -> Callable[[Callable[[Any, EffectContext], Awaitable[Any]]], CrashSafeTool[Any]]:
    """Decorator: ``async def f(args: Model, ctx: EffectContext)`` → :class:`CrashSafeTool`.

    The input model is the annotation of the first parameter. Bind a ledger
    before use: ``f.bind(store.ledger)``.
    """

    def decorate(fn: Callable[[Any, EffectContext], Awaitable[Any]]) -> CrashSafeTool[Any]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError("crash-safe tools must be async functions")
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2:
            raise TypeError("a crash-safe tool takes (input: Model, ctx: EffectContext)")
        model = get_type_hints(fn).get(params[0].name)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError("annotate the first parameter with a pydantic model")
        desc = description if description is not None else inspect.getdoc(fn) or ""
        return CrashSafeTool(name or fn.__name__, desc, model, fn, redrive=redrive)

    return decorate


class PureTool(ClientTool[M]):
    """A client tool without side effects (a lookup, a computation, an ack).

    Recovery may simply run it again to answer a ``requires_action`` pause it
    left behind, instead of interrupting the attempt and resubmitting the step
    (``structured_output``'s acknowledgement is treated the same way).
    """

    def __repr__(self) -> str:
        return f"PureTool(name={self.name!r}, input_model={self.input_model.__name__})"


def pure(tool: ClientTool[M]) -> PureTool[M]:
    """Declare ``tool`` side-effect free: safe for recovery to re-run (see :class:`PureTool`)."""
    return PureTool(tool.name, tool.description, tool.input_model, tool.fn)


def needs_ledger(tool: ClientTool[Any]) -> bool:
    """Whether ``tool`` runs behind the write-ahead ledger in a durable workflow:
    every client tool does, unless it is declared side-effect free
    (:func:`pure`, ``structured_output``) or already is a :class:`CrashSafeTool`."""
    return not isinstance(tool, CrashSafeTool | PureTool | StructuredOutput)


def ledgered(tool: ClientTool[M]) -> CrashSafeTool[M]:
    """A plain client tool behind the write-ahead ledger (bind a ledger before use).

    The tool keeps its ``fn(input, ctx: ToolContext)`` signature; its
    ``ctx.idempotency_key`` becomes the ledger key (tenant/chat/call), so the
    effect sees the same key live and when recovery re-drives a ``committing``
    call after a crash. The default re-drive is the tool itself, with that key:
    an effect that honours the key replays as a no-op.
    """
    if isinstance(tool, CrashSafeTool):
        return tool
    fn = tool.fn

    async def effect(value: M, ectx: EffectContext) -> Any:
        ctx = ToolContext(
            tool_call_id=ectx.tool_call_id,
            chat_id=ectx.chat_id,
            tool_name=ectx.tool_name,
            ledger_key=ectx.idempotency_key,
        )
        output = await fn(value, ctx)
        if isinstance(output, BaseModel):
            return output.model_dump(mode="json")
        try:
            json.dumps(output)
        except (TypeError, ValueError):
            # As the plain tool loop does: the model gets the text, the ledger JSON.
            return str(output)
        return output

    return CrashSafeTool(tool.name, tool.description, tool.input_model, effect)

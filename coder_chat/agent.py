# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""CoderAgent: one chat session, one turn per :meth:`CoderAgent.generate` call.

A *turn* is a tool loop over *segments* (agent-semantics §3.1): each segment
submits something (the prompt, or client tool results — or nothing, when
:meth:`CoderAgent.follow` re-attaches to a turn another process started), then
reads the chat stream until the run settles. If it settled in ``requires_action`` with client
tool calls, the agent runs the tools locally, posts the results and reads on
— on the SAME retained stream — until a segment ends without client calls.

Rules the agent enforces (each closes a failure window; how a segment ends —
interrupt, withdraw, keep the stream, strand — is decided by the pure
:func:`coder_chat.core.segment.teardown`, and this module only carries it out):

* attribution: only events past the turn's cursor count (see
  :mod:`coder_chat.core.translator`), so resumed turns never absorb earlier
  turns' content or usage, and a queued prompt never absorbs its predecessor's;
* per-segment ``request_timeout`` covering REST, stream, redial backoff and
  recovery fetches → ``CoderChatError(kind="timeout", retryable=True)``;
* a segment that ends without a terminal status fires one best-effort
  interrupt of its own chat (never of a promoted successor; a still-queued
  prompt is withdrawn instead of interrupting someone else's run);
* a ``CoderStreamError`` on a chat this turn created strands the chat
  (``stranded_chat_ids``) and discards the session (``chat_id`` → ``None``,
  ``last_known_chat_id`` keeps it for :meth:`archive`).

Caller deadlines (``generate(timeout=...)``, ``asyncio.timeout``) and
cancellation propagate unchanged (``TimeoutError`` / ``CancelledError``) after
the best-effort interrupt was fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from pydantic import BaseModel, SecretStr

from coder_chat.core.follow import (
    FollowPlan,
    history_covers,
    pick_queued,
    pick_turn,
    plan_follow,
)
from coder_chat.core.segment import (
    Ending,
    ReadEnd,
    ReadState,
    SegmentKind,
    SegmentState,
    Stop,
    read_end,
    teardown,
)
from coder_chat.core.text_ledger import Episode
from coder_chat.core.translator import (
    QueuedGate,
    ToolCall,
    TurnTranslator,
    pending_client_calls,
)
from coder_chat.core.usage import sum_usages
from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderChatError,
    CoderError,
    CoderStreamError,
    is_transient,
)
from coder_chat.events import (
    SegmentSettle,
    SegmentStart,
    TransportEmitter,
    TransportEventHandler,
)
from coder_chat.history import fetch_until
from coder_chat.models import (
    ChatInputPart,
    CreateChatMessageRequest,
    CreateChatRequest,
    DynamicToolDefinition,
)
from coder_chat.models import ToolResult as WireToolResult
from coder_chat.rest import ChatClient
from coder_chat.results import (
    ArchiveResult,
    ClientToolCall,
    GenerateResult,
    InterruptResult,
    StepResult,
    StructuredResult,
    decode_args,
    step_from_history,
)
from coder_chat.segment_reader import read_until_settled
from coder_chat.settings import CoderSettings
from coder_chat.stop import stop_chat
from coder_chat.stream import ChatStreamReader, StreamOptions
from coder_chat.tools import (
    ClientTool,
    StructuredOutput,
    ToolContext,
    ToolOutcome,
    tool_definitions,
)

__all__ = [
    "AgentTimings",
    "ArchiveResult",
    "ClientToolCall",
    "CoderAgent",
    "GenerateResult",
    "InterruptResult",
    "NoTurnToFollowError",
    "StepResult",
    "StructuredResult",
]

M = TypeVar("M", bound=BaseModel)

_log = logging.getLogger(__name__)

#: Largest timer value the TypeScript SDK accepts (ms); larger/invalid → default.
_MAX_DELAY_S = (2**31 - 1) / 1000.0


def _sane_delay(value: float | None, default: float) -> float:
    if value is None or not isinstance(value, int | float) or isinstance(value, bool):
        return default
    if value != value or value < 0 or value > _MAX_DELAY_S:  # NaN, negative, huge
        return default
    return float(value)


@dataclass(frozen=True, slots=True)
class AgentTimings:
    """Time constants of the agent (seconds). Tests shorten them; production keeps defaults.

    ``action_grace``: wait for a lost ``action_required`` before recovering it from
    history (2 s). ``settle_deadline``: archive window (15 s). ``settle_retry_delay``:
    archive's poll interval: status re-reads while a run winds down, retries on
    409 (1 s). ``wind_down``: bound of the
    max-steps wind-down submit/interrupt (8 s). ``interrupt``: bound of each
    best-effort interrupt / queue withdrawal (15 s).
    """

    action_grace: float = 2.0
    settle_deadline: float = 15.0
    settle_retry_delay: float = 1.0
    wind_down: float = 8.0
    interrupt: float = 15.0

    def sanitized(self) -> AgentTimings:
        d = AgentTimings()
        return AgentTimings(
            action_grace=_sane_delay(self.action_grace, d.action_grace),
            settle_deadline=_sane_delay(self.settle_deadline, d.settle_deadline),
            settle_retry_delay=_sane_delay(self.settle_retry_delay, d.settle_retry_delay),
            wind_down=_sane_delay(self.wind_down, d.wind_down),
            interrupt=_sane_delay(self.interrupt, d.interrupt),
        )


# --------------------------------------------------------------------------- results


class NoTurnToFollowError(CoderAgentError):
    """:meth:`CoderAgent.follow` found no user message to follow.

    With no hint, the chat has no user message after ``last_seen_message_id``
    (nothing was submitted since the checkpoint, or a submitted prompt is still
    queued behind another run: pass its marker to follow it); with a hint, no
    user message (and, for a marker, no queued prompt) matches it.
    """

    def __init__(
        self, chat_id: str, cursor: int | None, user_message_id: int | None, marker: str | None
    ) -> None:
        if user_message_id is not None:
            what = f"user message {user_message_id}"
        elif marker is not None:
            what = f"a user message carrying marker {marker!r}"
        elif cursor is not None:
            what = f"a user message after message {cursor}"
        else:
            what = "a user message"
        super().__init__(f"no turn to follow in chat {chat_id}: history holds no {what}")
        self.chat_id = chat_id
        self.cursor = cursor
        self.user_message_id = user_message_id
        self.marker = marker


# --------------------------------------------------------------------------- internals


@dataclass(slots=True)
class _Segment:
    """Outcome of one segment (internal)."""

    translator: TurnTranslator
    chat_id: str
    user_message_id: int | None
    follow: FollowPlan | None = None


@dataclass(frozen=True, slots=True)
class _FollowHint:
    user_message_id: int | None
    marker: str | None


@dataclass(slots=True)
class _SegmentRun:
    """One segment's progress as its I/O shell records it (teardown reads it)."""

    state: SegmentState
    tr: TurnTranslator | None = None
    reader: ChatStreamReader | None = None
    user_message_id: int | None = None
    stream_failed: bool = False
    anchor_on_first_user: bool | None = None
    follow: FollowPlan | None = None


def _check_session(chat_id: str | None, last_seen_message_id: int | None) -> None:
    """The session a constructor or :meth:`CoderAgent.resume` is given: a non-empty
    chat id, and a cursor only with it, a positive JSON-safe integer."""
    if last_seen_message_id is not None:
        if (
            isinstance(last_seen_message_id, bool)
            or not isinstance(last_seen_message_id, int)
            or last_seen_message_id <= 0
            or last_seen_message_id > 2**53 - 1
        ):
            raise CoderAgentError("last_seen_message_id must be a positive integer")
        if not chat_id:
            raise CoderAgentError("last_seen_message_id requires chat_id")
    if chat_id is not None and (not isinstance(chat_id, str) or not chat_id):
        raise CoderAgentError("chat_id must be a non-empty string")


def _read_state(tr: TurnTranslator) -> ReadState:
    return ReadState(
        reached_terminal=tr.reached_terminal,
        gated=tr.gated,
        queued_id=tr.queued_id,
        paused_for_tools=tr.terminal_status == "requires_action"
        and bool(tr.client_calls)
        and not tr.promoted,
    )


def _wire_results(outcomes: Sequence[ToolOutcome]) -> list[WireToolResult]:
    return [
        WireToolResult(tool_call_id=o.tool_call_id, output=o.output, is_error=o.is_error)
        for o in outcomes
    ]


class _TornDown(CoderAgentError):
    """The agent was closed while a turn was reading its stream (a teardown)."""


class CoderAgent:
    """One chat session against chatd (single-flight: one turn at a time).

    Construction does no I/O. ``base_url``/``token``/``organization_id`` default
    to ``CODER_URL``/``CODER_SESSION_TOKEN``/``CODER_ORG_ID`` (and
    ``request_timeout`` to ``CODER_REQUEST_TIMEOUT``) unless a ``client`` is given.

    Args:
        chat_id: resume this chat (``None``: the first turn creates one).
        last_seen_message_id: resume cursor saved from a previous step
            (positive int, requires ``chat_id``); skips one history probe.
        tools: client tools (declared at chat creation; re-supply them on resume).
        system_prompt, labels, workspace_id, mcp_server_ids, model_config_id:
            chat creation options (ignored when resuming).
        request_timeout: per-segment budget in seconds (``None``/≤0 = unbounded).
        on_transport_event: observability hook (never receives the token).
        max_steps: tool-loop cap per turn (64).
        stream_options: stream reader tunables (backoff, budget).
        timings: agent time constants (lost-event grace, archive window…).
        before_interrupt: awaited with the chat id before every interrupt the
            agent sends of its own turn's chat (a failed segment's teardown, the
            step cap's wind-down): a durable caller journals the attempt cut short
            there, so a later recovery never mistakes the truncated attempt for a
            finished one. If it raises, that interrupt is not sent (the run is
            left for the caller's recovery, which must then find it live).
        before_send: awaited with the chat id (``None`` before a create) right
            before every prompt the agent sends — a chat's creation or a user
            message, never tool results. If it raises, nothing is sent and the
            turn fails with that error. A durable caller proves there that it
            still holds what it claimed before the turn began (a capacity slot
            it may have lost while its process stalled): the window between
            claiming and sending then shrinks to the request itself.
        leave_landed_runs: a segment that fails transiently (a transport error —
            e.g. a POST that landed but whose response was lost — or a 408/425/429/5xx
            answer) after its submission went out does NOT interrupt the chat: the
            run may be the turn's own live continuation, and a durable caller's
            recovery follows it instead (an interrupt would throw the work away,
            and a resubmission lets the model repeat a committed tool call under a
            new id). :attr:`left_run_live` then names the chat. Default off: the
            plain SDK stops what nobody reads (agent-semantics §5.3).
    """

    def __init__(
        self,
        *,
        client: ChatClient | None = None,
        base_url: str | None = None,
        token: SecretStr | str | None = None,
        organization_id: str | None = None,
        chat_id: str | None = None,
        last_seen_message_id: int | None = None,
        tools: Sequence[ClientTool[Any]] = (),
        system_prompt: str | None = None,
        labels: Mapping[str, str] | None = None,
        workspace_id: str | None = None,
        mcp_server_ids: Sequence[str] | None = None,
        model_config_id: str | None = None,
        request_timeout: float | None = None,
        on_transport_event: TransportEventHandler | None = None,
        max_steps: int = 64,
        stream_options: StreamOptions | None = None,
        timings: AgentTimings | None = None,
        before_interrupt: Callable[[str], Awaitable[None]] | None = None,
        before_send: Callable[[str | None], Awaitable[None]] | None = None,
        leave_landed_runs: bool = False,
    ) -> None:
        _check_session(chat_id, last_seen_message_id)
        if max_steps < 1:
            raise CoderAgentError("max_steps must be >= 1")
        self._tools: dict[str, ClientTool[Any]] = {}
        try:
            tool_definitions(tools)
        except ValueError as exc:
            raise CoderAgentError(str(exc)) from None
        for tool in tools:
            self._tools[tool.name] = tool

        settings: CoderSettings | None = None
        if client is None:
            settings = CoderSettings()
            url = base_url or settings.url
            secret = token if token is not None else settings.session_token
            if not url or secret is None:
                raise CoderAgentError(
                    "pass client=, or base_url= and token= (or set CODER_URL and "
                    "CODER_SESSION_TOKEN)"
                )
            client = ChatClient(
                url,
                secret,
                organization_id=organization_id or settings.org_id,
                timeout=settings.http_timeout,
                verify=settings.verify_tls,
                on_transport_event=on_transport_event,
            )
            self._owns_client = True
            if request_timeout is None:
                request_timeout = settings.request_timeout
        else:
            self._owns_client = False
        self._client = client
        self._organization_id = organization_id or client.organization_id
        self._emitter = TransportEmitter(on_transport_event)

        self._system_prompt = system_prompt
        self._labels = dict(labels) if labels else None
        self._workspace_id = workspace_id
        self._mcp_server_ids = list(mcp_server_ids) if mcp_server_ids else None
        self._model_config_id = model_config_id
        self._request_timeout = (
            float(request_timeout) if request_timeout and request_timeout > 0 else None
        )
        self._max_steps = max_steps
        self._stream_options = stream_options
        self._timings = (timings or AgentTimings()).sanitized()

        self._chat_id: str | None = chat_id
        self._cursor = last_seen_message_id or 0
        self._last_known_chat_id: str | None = chat_id
        self._stranded: dict[str, None] = {}
        self._submitted: set[str] = set()
        self._reader: ChatStreamReader | None = None
        self._active_reader: ChatStreamReader | None = None
        self._in_flight = False
        self._segment_no = 0
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._turn_deadline: float | None = None
        self._before_interrupt = before_interrupt
        self._before_send = before_send
        self._leave_landed_runs = leave_landed_runs
        self._left_live: str | None = None
        # Server-assigned workspace/MCP of a chat this instance created (for is_retryable).
        self._assigned_workspace: str | None = None
        self._assigned_mcp: list[str] = []

    # ------------------------------------------------------------------ state

    @property
    def client(self) -> ChatClient:
        """The REST client (for history reads, recovery, sweeps)."""
        return self._client

    @property
    def chat_id(self) -> str | None:
        """The session's chat (``None`` before the first turn or after a discard)."""
        return self._chat_id

    @property
    def last_seen_message_id(self) -> int | None:
        """Resume cursor to checkpoint with ``chat_id`` (``None`` when unknown)."""
        return self._cursor or None

    @property
    def last_known_chat_id(self) -> str | None:
        """Cleanup target: survives :meth:`reset_session` and discards until archived."""
        return self._last_known_chat_id

    @property
    def stranded_chat_ids(self) -> list[str]:
        """Chats dropped by automatic session discards and not yet archived (oldest first)."""
        return list(self._stranded)

    @property
    def client_tool_names(self) -> frozenset[str]:
        """Names of the client tools this agent executes."""
        return frozenset(self._tools)

    @property
    def tools(self) -> Mapping[str, ClientTool[Any]]:
        return dict(self._tools)

    @property
    def left_run_live(self) -> str | None:
        """The chat whose live run the last turn's transient failure left alone
        (``leave_landed_runs``), else ``None``; reset when a turn starts."""
        return self._left_live

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def __repr__(self) -> str:
        return (
            f"CoderAgent(chat_id={self._chat_id!r}, last_seen_message_id="
            f"{self.last_seen_message_id!r}, tools={sorted(self._tools)!r})"
        )

    # ------------------------------------------------------------------ turn

    async def generate(self, prompt: str, *, timeout: float | None = None) -> GenerateResult:
        """Run one turn and return its result.

        ``timeout`` bounds the whole turn (all segments and tool executions); on
        expiry the run is interrupted best-effort and ``TimeoutError`` is raised.
        Raises ``CoderApiError`` (REST), ``CoderChatError`` (server error,
        ``request_timeout``, stream closed, queued submission lost) or
        ``CoderStreamError`` (stream could not be kept alive).
        """
        if self._in_flight:
            raise CoderAgentError("CoderAgent.generate is already running on this instance")
        if self._closed:
            raise CoderAgentError("CoderAgent is closed")
        if not isinstance(prompt, str) or not prompt.strip():
            raise CoderAgentError("prompt must be a non-empty string")
        return await self._bounded_turn(SegmentKind.PROMPT, prompt, timeout)

    async def follow(
        self,
        *,
        timeout: float | None = None,
        user_message_id: int | None = None,
        marker: str | None = None,
    ) -> GenerateResult:
        """Follow this chat's live turn to its settle without sending anything.

        For a process that re-attaches after a crash: construct the agent with
        the checkpointed ``chat_id`` (and ``last_seen_message_id``) and the same
        client tools, then ``follow()``. No user message is posted. The turn to
        follow is ``user_message_id`` if given, else the newest user message
        containing ``marker`` (or, if none, a queued prompt containing it: the
        follow waits behind it until chatd promotes it), else the first user
        message after the cursor (with no cursor: the chat's last user message).

        The turn's finished tool rounds are rebuilt from history; the rest is
        read from the stream exactly as :meth:`generate` reads it: pending client
        calls (a ``requires_action`` pause, e.g. left by the dead process) are
        answered with this agent's tools, the tool loop runs to the end, and the
        result is the :class:`GenerateResult` the original ``generate()`` would
        have returned (``user_message_id`` is the followed prompt). A turn that
        already settled returns its result at once.

        ``timeout`` bounds the whole follow, ``request_timeout`` each segment, as
        for :meth:`generate`; a follow that ends unsettled (timeout, stream
        failure, cancellation) interrupts the run best-effort, as :meth:`generate`
        would have. Raises :class:`NoTurnToFollowError` when history holds no
        matching user message, and :class:`CoderAgentError` without a ``chat_id``.
        """
        if self._in_flight:
            raise CoderAgentError("CoderAgent is already running a turn on this instance")
        if self._closed:
            raise CoderAgentError("CoderAgent is closed")
        if self._chat_id is None:
            raise CoderAgentError("follow() needs a chat_id (construct the agent with chat_id=)")
        if user_message_id is not None and (
            isinstance(user_message_id, bool)
            or not isinstance(user_message_id, int)
            or user_message_id <= 0
        ):
            raise CoderAgentError("user_message_id must be a positive integer")
        if marker is not None and not marker:
            raise CoderAgentError("marker must be a non-empty string")
        hint = _FollowHint(user_message_id, marker)
        return await self._bounded_turn(SegmentKind.FOLLOW, None, timeout, hint)

    async def _bounded_turn(
        self,
        first: SegmentKind,
        prompt: str | None,
        timeout: float | None,
        follow: _FollowHint | None = None,
    ) -> GenerateResult:
        self._in_flight = True
        self._left_live = None
        loop = asyncio.get_running_loop()
        self._turn_deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        try:
            async with asyncio.timeout_at(self._turn_deadline):
                return await self._turn(first, prompt, follow)
        finally:
            self._in_flight = False
            self._turn_deadline = None

    async def generate_structured(
        self, answer: StructuredOutput[M], prompt: str, *, timeout: float | None = None
    ) -> StructuredResult[M]:
        """Run a turn and return ``answer``'s value; re-prompt once if none validated.

        ``answer`` must be one of this agent's tools. The nudge is sent only when
        the turn finished ``stop`` (an idle chat): a chat that is still busy or
        paused is never re-prompted. ``timeout`` bounds each of the (at most two)
        turns.
        """
        if answer.name not in self._tools:
            raise CoderAgentError(f"{answer.name!r} is not one of this agent's tools")
        result = await self.generate(prompt, timeout=timeout)
        value = answer.pick(result)
        if value is not None or result.finish_reason != "stop":
            return StructuredResult(value, result, False)
        second = await self.generate(answer.nudge, timeout=timeout)
        return StructuredResult(answer.pick(second), second, True)

    async def _turn(
        self, first: SegmentKind, prompt: str | None, follow: _FollowHint | None = None
    ) -> GenerateResult:
        steps: list[StepResult] = []
        client_calls: list[ClientToolCall] = []
        outcomes: list[ToolOutcome] = []
        user_message_id: int | None = None
        chat_id: str | None = None
        created_here = self._chat_id is None
        closed: set[Episode] = set()
        kind = first
        while True:
            try:
                seg = await self._segment(
                    kind,
                    prompt=prompt,
                    results=outcomes,
                    follow=follow,
                    created_turn=created_here,
                    closed_episodes=closed,
                )
            except BaseException:
                self._close_reader_nowait()
                raise
            if kind is first:
                user_message_id = seg.user_message_id
                if seg.follow is not None:
                    # A follower: the turn's finished tool rounds come from history.
                    for done in seg.follow.done_steps:
                        step = step_from_history(done, len(steps) + 1, self._tools.keys())
                        steps.append(step)
                        client_calls.extend(step.client_tool_calls)
            kind = SegmentKind.RESULTS
            step_no = len(steps) + 1
            tr = seg.translator
            chat_id = seg.chat_id
            step_calls: list[ClientToolCall] = []
            outcomes = []
            if tr.finish_reason == "tool-calls" and tr.client_calls:
                try:
                    outcomes = await self._run_tools(tr.client_calls, chat_id)
                except BaseException:
                    # Cancelled while tools ran. Deliberately NO interrupt: an interrupt
                    # of a requires_action chat writes synthetic error results and revives
                    # the run, destroying the pause — the only pending record of a tool
                    # effect that may have committed (crash recovery reconciles it).
                    self._close_reader_nowait()
                    raise
                for call, outcome in zip(tr.client_calls, outcomes, strict=True):
                    step_calls.append(
                        ClientToolCall(
                            call.tool_call_id,
                            call.tool_name,
                            decode_args(call.input),
                            outcome.output,
                            outcome.is_error,
                            step_no,
                        )
                    )
            client_calls.extend(step_calls)
            steps.append(
                StepResult(
                    step=step_no,
                    text=tr.text,
                    reasoning=tr.reasoning,
                    finish_reason=tr.finish_reason,
                    raw_status=tr.raw_status,
                    usage=tr.usage,
                    client_tool_calls=step_calls,
                    server_tool_calls=list(tr.server_calls),
                    server_tool_results=list(tr.server_results),
                    sources=list(tr.sources),
                    message_ids=list(tr.message_ids),
                )
            )
            if not outcomes:
                break
            if step_no >= self._max_steps:
                await self._wind_down(chat_id, outcomes)
                break
        assert chat_id is not None
        self._close_reader_nowait()
        last = steps[-1]
        message_ids = sorted({mid for s in steps for mid in s.message_ids})
        return GenerateResult(
            text=last.text,
            finish_reason=last.finish_reason,
            raw_status=last.raw_status,
            usage=sum_usages(s.usage for s in steps),
            steps=steps,
            chat_id=chat_id,
            user_message_id=user_message_id,
            message_ids=message_ids,
            client_tool_calls=client_calls,
            server_tool_calls=[c for s in steps for c in s.server_tool_calls],
            server_tool_results=[r for s in steps for r in s.server_tool_results],
        )

    async def _run_tools(self, calls: Sequence[ToolCall], chat_id: str) -> list[ToolOutcome]:
        async def run_one(call: ToolCall) -> ToolOutcome:
            tool = self._tools.get(call.tool_name)
            if tool is None:
                return ToolOutcome(
                    call.tool_call_id,
                    call.tool_name,
                    f"Unknown client tool {call.tool_name!r}",
                    True,
                )
            ctx = ToolContext(tool_call_id=call.tool_call_id, chat_id=chat_id, tool_name=tool.name)
            return await tool.run(call.input, ctx)

        return list(await asyncio.gather(*(run_one(c) for c in calls)))

    async def _wind_down(self, chat_id: str, outcomes: list[ToolOutcome]) -> None:
        """The step cap hit on a tool-call step: answer the pause or stop the run.

        Leaving it in ``requires_action`` would strand the chat (follow-ups queue
        forever), so the recorded outcomes are submitted (bounded), falling back
        to an interrupt.
        """
        self._close_reader_nowait()
        fresh = [o for o in outcomes if o.tool_call_id not in self._submitted]
        try:
            if fresh:
                await self._client.submit_tool_results(
                    chat_id, _wire_results(fresh), timeout=self._timings.wind_down
                )
                self._submitted.update(o.tool_call_id for o in fresh)
                return
        except (CoderError, TimeoutError, OSError) as exc:
            _log.debug("wind-down submit failed: %s", type(exc).__name__)
        if not await self._journal_interrupt(chat_id):
            return
        with contextlib.suppress(CoderError, TimeoutError, OSError):
            await self._client.interrupt_chat(chat_id, timeout=self._timings.wind_down)

    # ------------------------------------------------------------------ segment

    async def _segment(
        self,
        kind: SegmentKind,
        *,
        prompt: str | None = None,
        results: Sequence[ToolOutcome] = (),
        follow: _FollowHint | None = None,
        created_turn: bool,
        closed_episodes: set[Episode],
    ) -> _Segment:
        self._segment_no += 1
        seg_no = self._segment_no
        started = time.perf_counter()
        start_chat = self._chat_id
        self._emitter.emit(lambda: SegmentStart(segment=seg_no, chat_id=start_chat))
        run = _SegmentRun(SegmentState(chat_id=self._chat_id))
        ending: Ending = "teardown"
        error_info: dict[str, str] | None = None
        failure: BaseException | None = None
        try:
            await self._run_segment(run, kind, prompt, results, follow, closed_episodes)
            assert run.tr is not None and run.state.chat_id is not None
            ending = "clean"
            return _Segment(run.tr, run.state.chat_id, run.user_message_id, run.follow)
        except asyncio.CancelledError:
            ending = "failure"
            if self._turn_deadline_passed():
                error_info = {"name": "TimeoutError", "message": "turn timeout"}
            else:
                error_info = {"name": "CancelledError", "message": "the turn was cancelled"}
            raise
        except _TornDown:
            raise
        except BaseException as exc:
            ending = "failure"
            failure = exc
            error_info = {"name": type(exc).__name__, "message": str(exc)}
            raise
        finally:
            self._end_segment(run, ending, created_turn, failure)
            tr, reader = run.tr, run.reader
            settle_chat = run.state.chat_id
            settle_reader = reader.reader_id if reader is not None else None
            status = tr.raw_status if tr is not None and ending != "teardown" else None
            finish = tr.finish_reason if tr is not None and ending == "clean" else None
            self._emitter.emit(
                lambda: SegmentSettle(
                    segment=seg_no,
                    chat_id=settle_chat,
                    reader=settle_reader,
                    duration_ms=round((time.perf_counter() - started) * 1000.0, 3),
                    ending=ending,
                    status=status,
                    finish_reason=finish,
                    error=error_info,
                )
            )

    async def _run_segment(
        self,
        run: _SegmentRun,
        kind: SegmentKind,
        prompt: str | None,
        results: Sequence[ToolOutcome],
        follow: _FollowHint | None,
        closed_episodes: set[Episode],
    ) -> None:
        """Submit, then read until the run settles; errors mapped to the agent's types."""
        deadline = asyncio.timeout(self._request_timeout)  # None: unbounded
        try:
            async with deadline:
                after_id, gate = await self._submit(run, kind, prompt, results, follow)
                chat_id = run.state.chat_id
                assert chat_id is not None
                self._last_known_chat_id = chat_id
                tr = run.tr = TurnTranslator(
                    client_tool_names=self._tools.keys(),
                    cursor=after_id,
                    submitted_tool_call_ids=self._submitted,
                    queued=gate,
                    closed_episodes=closed_episodes,
                    anchor_on_first_user=run.anchor_on_first_user,
                )
                reader = run.reader = self._acquire_reader(
                    chat_id, after_id, resume=kind is SegmentKind.RESULTS
                )
                await read_until_settled(
                    reader,
                    tr,
                    action_grace=self._timings.action_grace,
                    fetch_pending=lambda after_id: self._fetch_pending(chat_id, after_id),
                )
                end = read_end(
                    settled=tr.settled,
                    dead_end=tr.failure is not None,
                    server_error=tr.error is not None,
                    reader_closed=reader.closed,
                )
                if end is ReadEnd.DEAD_END:
                    assert tr.failure is not None
                    raise CoderChatError(tr.failure.message, kind=tr.failure.kind)
                if end is ReadEnd.SERVER_ERROR:
                    assert tr.error is not None
                    raise CoderChatError.from_payload(tr.error)
                if end is ReadEnd.TORN_DOWN:
                    raise _TornDown("the turn was torn down: the agent was closed mid-turn")
                if end is ReadEnd.STREAM_CLOSED:
                    raise CoderChatError(
                        "Coder chat stream ended before the turn settled",
                        kind="stream_closed",
                        retryable=True,
                    )
                tr.finish()
                if kind is not SegmentKind.RESULTS and not tr.gated:
                    run.user_message_id = run.user_message_id or tr.effective_cursor or None
        except TimeoutError as exc:
            if deadline.expired():
                ms = round((self._request_timeout or 0) * 1000)
                raise CoderChatError(
                    f"Coder Agent turn exceeded its {ms}ms requestTimeoutMs budget.",
                    kind="timeout",
                    retryable=True,
                ) from exc
            raise
        except CoderStreamError as exc:
            run.stream_failed = True
            retryable, reason = self._stream_retry_verdict(run.state.created_chat)
            raise exc.with_retry(retryable, reason) from exc.cause
        except CoderApiError:
            run.state = run.state.rejected()
            raise
        except CoderAgentError as exc:
            if isinstance(exc, CoderChatError | _TornDown) or run.reader is None:
                raise
            # An unparseable frame: the stream failed mid-turn.
            raise CoderChatError(
                "Coder chat stream failed mid-turn", kind="stream_closed", retryable=True
            ) from exc

    async def _submit(
        self,
        run: _SegmentRun,
        kind: SegmentKind,
        prompt: str | None,
        results: Sequence[ToolOutcome],
        follow: _FollowHint | None = None,
    ) -> tuple[int, QueuedGate | None]:
        """The REST phase: returns the stream cursor and the queue gate (if queued)."""
        if kind is SegmentKind.FOLLOW:
            # Nothing is sent: read history once, then follow from the live step.
            assert self._chat_id is not None and follow is not None
            plan = await self._plan_follow(self._chat_id, follow)
            run.follow = plan
            run.user_message_id = plan.user_message_id
            run.anchor_on_first_user = False
            self._submitted.update(plan.answered_call_ids)
            run.state = run.state.adopted(self._chat_id)
            return plan.cursor, plan.queued
        if self._chat_id is not None and self._cursor == 0:
            page = await self._client.get_messages(self._chat_id, limit=1)
            self._cursor = page.messages[0].id if page.messages else 0
        after_id = self._cursor
        if kind is SegmentKind.RESULTS:
            if self._chat_id is None:
                raise CoderChatError("cannot submit tool results before a chat exists")
            chat_id = self._chat_id
            fresh = [o for o in results if o.tool_call_id not in self._submitted]
            if fresh:
                run.state = run.state.sending()
                await self._client.submit_tool_results(chat_id, _wire_results(fresh))
                self._submitted.update(o.tool_call_id for o in fresh)
            run.state = run.state.landed(chat_id)
            return after_id, None
        assert prompt is not None
        content = [ChatInputPart.text_part(prompt)]
        if self._before_send is not None:
            # Before the state says "sending": a refusal here sent nothing.
            await self._before_send(self._chat_id)
        run.state = run.state.sending()
        if self._chat_id is None:
            chat = await self._client.create_chat(self._create_request(content))
            self._chat_id = chat.id
            self._assigned_workspace = chat.workspace_id
            self._assigned_mcp = list(chat.mcp_server_ids)
            run.state = run.state.landed(chat.id, created=True)
            return after_id, None
        chat_id = self._chat_id
        resp = await self._client.create_message(
            chat_id,
            CreateChatMessageRequest(content=content, model_config_id=self._model_config_id),
        )
        run.state = run.state.landed(chat_id)
        if resp.message is not None:
            return resp.message.id, None
        if resp.queued:
            qm = resp.queued_message
            return after_id, QueuedGate(
                qm.id if qm is not None else None, qm.content if qm is not None else content
            )
        return after_id, None

    async def _plan_follow(self, chat_id: str, hint: _FollowHint) -> FollowPlan:
        cursor = self._cursor or None
        plan = await self._plan_from_history(chat_id, hint, cursor)
        if plan is None and hint.marker is not None and hint.user_message_id is None:
            # Not in history: the prompt may still be queued behind another run.
            # One response gives the queue and the newest id together, so the
            # promoted prompt (if it comes) is past the cursor we dial from.
            page = await self._client.get_messages(chat_id, limit=1)
            entry = pick_queued(page.queued_messages, hint.marker)
            if entry is not None:
                newest = page.messages[0].id if page.messages else 0
                return FollowPlan(None, cursor=newest, queued=entry)
            # Promoted between the two reads: then it is in history now.
            plan = await self._plan_from_history(chat_id, hint, cursor)
        if plan is None:
            raise NoTurnToFollowError(chat_id, cursor, hint.user_message_id, hint.marker)
        return plan

    async def _plan_from_history(
        self, chat_id: str, hint: _FollowHint, cursor: int | None
    ) -> FollowPlan | None:
        messages, _ = await fetch_until(
            self._client,
            chat_id,
            lambda ms: history_covers(
                ms, after_id=cursor, user_message_id=hint.user_message_id, marker=hint.marker
            ),
        )
        uid = pick_turn(
            messages, after_id=cursor, user_message_id=hint.user_message_id, marker=hint.marker
        )
        if uid is None:
            return None
        return plan_follow(messages, user_message_id=uid, client_tool_names=self._tools.keys())

    def _end_segment(
        self,
        run: _SegmentRun,
        ending: Ending,
        created_turn: bool,
        failure: BaseException | None = None,
    ) -> None:
        """Apply :func:`coder_chat.core.segment.teardown` to the stream and the chat."""
        tr, reader = run.tr, run.reader
        self._active_reader = None
        if tr is not None:
            self._cursor = max(self._cursor, tr.max_message_id)
        decision = teardown(
            run.state,
            _read_state(tr) if tr is not None else None,
            ending=ending,
            stream_failed=run.stream_failed,
            created_turn=created_turn,
        )
        if decision.keep_stream and reader is not None:
            reader.pause()
            self._reader = reader
        else:
            if reader is not None:
                reader.close_nowait()
            if self._reader is not None and self._reader is not reader:
                self._reader.close_nowait()
            self._reader = None
        chat_id = run.state.chat_id
        if chat_id is None:
            return
        if decision.strand:
            self._stranded[chat_id] = None
        if decision.stop is Stop.INTERRUPT and self._leave_landed_runs and is_transient(failure):
            # The submission went out and only its answer (or a read) failed: the
            # run may be this turn's own live continuation. Left for recovery to
            # follow — cutting it would repeat its committed tool calls.
            self._left_live = chat_id
        elif decision.stop is Stop.INTERRUPT:
            self._fire_interrupt(chat_id)
        elif decision.stop is Stop.WITHDRAW and decision.withdraw_id is not None:
            self._fire_withdraw(chat_id, decision.withdraw_id)
        if decision.strand:
            self._discard_session(chat_id)

    def _turn_deadline_passed(self) -> bool:
        deadline = self._turn_deadline
        return deadline is not None and asyncio.get_running_loop().time() >= deadline

    def _create_request(self, content: list[ChatInputPart]) -> CreateChatRequest:
        org = self._organization_id
        if not org:
            raise CoderAgentError(
                "organization_id is required to create a chat (pass it or set CODER_ORG_ID)"
            )
        tools = [
            DynamicToolDefinition(
                name=t.name, description=t.description, input_schema=t.input_schema()
            )
            for t in self._tools.values()
        ]
        return CreateChatRequest(
            organization_id=org,
            content=content,
            client_type="api",
            system_prompt=self._system_prompt,
            unsafe_dynamic_tools=tools or None,
            model_config_id=self._model_config_id,
            workspace_id=self._workspace_id,
            mcp_server_ids=self._mcp_server_ids,
            labels=self._labels,
        )

    def _stream_retry_verdict(self, created_chat: bool) -> tuple[bool, str | None]:
        if not created_chat:
            return False, "not retryable: the chat existed before this call"
        if self._workspace_id or self._assigned_workspace:
            return False, "not retryable: the chat has a workspace"
        if self._mcp_server_ids or self._assigned_mcp:
            return False, "not retryable: the chat has MCP servers"
        return True, None

    def _acquire_reader(self, chat_id: str, after_id: int, *, resume: bool) -> ChatStreamReader:
        retained = self._reader
        if resume and retained is not None and retained.reusable_for(chat_id):
            retained.resume()
            self._active_reader = retained
            return retained
        if retained is not None:
            retained.close_nowait()
        self._reader = None
        reader = ChatStreamReader(
            self._client, chat_id, after_id or None, options=self._stream_options
        )
        reader.start()
        self._active_reader = reader
        return reader

    async def _fetch_pending(
        self, chat_id: str, after_id: int
    ) -> tuple[list[Any], list[dict[str, Any]]] | None:
        """Lost ``action_required``: derive the pending client calls from history."""
        try:
            page = await self._client.get_messages(chat_id, limit=200)
        except (CoderAgentError, OSError, TimeoutError):
            return None  # keep waiting on the stream
        turn, calls = pending_client_calls(
            page.messages,
            after_id=after_id,
            client_tool_names=self._tools.keys(),
            submitted_tool_call_ids=self._submitted,
        )
        return (turn, calls) if calls else None

    # ------------------------------------------------------------------ teardown helpers

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _fire_interrupt(self, chat_id: str) -> None:
        """Best-effort, fire-and-forget interrupt of this turn's own chat."""

        async def run() -> None:
            if not await self._journal_interrupt(chat_id):
                return
            with contextlib.suppress(Exception):
                await self._client.interrupt_chat(chat_id, timeout=self._timings.interrupt)

        self._spawn(run())

    async def _journal_interrupt(self, chat_id: str) -> bool:
        """Run ``before_interrupt``; False (do not interrupt) when it failed."""
        if self._before_interrupt is None:
            return True
        try:
            await self._before_interrupt(chat_id)
        except Exception as exc:
            _log.warning(
                "before_interrupt failed (%s): chat %s is left for recovery",
                type(exc).__name__,
                chat_id,
            )
            return False
        return True

    def _fire_withdraw(self, chat_id: str, queued_id: int) -> None:
        """A still-queued prompt is withdrawn, never left to run unattended."""

        async def run() -> None:
            with contextlib.suppress(Exception):
                await self._client.delete_queued_message(
                    chat_id, queued_id, timeout=self._timings.interrupt
                )

        self._spawn(run())

    def _close_reader_nowait(self) -> None:
        if self._reader is not None:
            self._reader.close_nowait()
            self._reader = None

    def _discard_session(self, chat_id: str | None) -> None:
        if chat_id is not None and self._chat_id == chat_id:
            self.reset_session()

    async def wait_background(self, timeout: float | None = 5.0) -> None:
        """Wait for fire-and-forget interrupts/withdrawals (bounded)."""
        tasks = set(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    # ------------------------------------------------------------------ session ops

    def reset_session(self) -> None:
        """Forget the chat: ``chat_id`` → None, cursor cleared, retained stream closed.

        ``last_known_chat_id`` is kept (cleanup target); nothing is stranded.
        """
        self._chat_id = None
        self._cursor = 0
        self._submitted = set()
        self._assigned_workspace = None
        self._assigned_mcp = []
        self._close_reader_nowait()

    def resume(self, chat_id: str, *, last_seen_message_id: int | None = None) -> None:
        """Point the session at an existing chat (no I/O): what constructing the agent
        with ``chat_id`` does, for an agent that already exists — e.g. one whose
        checkpointed chat was archived, when recovery finds the step's chat elsewhere.
        The previous session is reset first (:meth:`reset_session`)."""
        if chat_id is None:
            raise CoderAgentError("chat_id must be a non-empty string")
        _check_session(chat_id, last_seen_message_id)
        self.reset_session()
        self._chat_id = self._last_known_chat_id = chat_id
        self._cursor = last_seen_message_id or 0

    async def interrupt(self, *, timeout: float | None = None) -> InterruptResult:
        """Interrupt the session's chat (or the last known one).

        Resolves on acknowledgement; the run keeps winding down briefly. A chat
        with no live run answers 409 (``CoderApiError``).
        """
        target = self._chat_id or self._last_known_chat_id
        if target is None:
            return InterruptResult(False, None)
        self._close_paused_reader()
        await self._client.interrupt_chat(target, timeout=timeout)
        return InterruptResult(True, target)

    async def archive(self, *, timeout: float | None = None) -> ArchiveResult:
        """Stop and archive stranded chats (oldest first), then the session's chat.

        Each target is brought to rest with :func:`coder_chat.stop.stop_chat`: a
        live run is interrupted, a ``requires_action`` pause twice (the first
        interrupt only closes its pending calls and revives the run), and the
        archive is retried on 409 every ``timings.settle_retry_delay``, all
        within one ``timings.settle_deadline`` window shared by the targets.
        Each success clears that id from ``stranded_chat_ids`` and
        ``last_known_chat_id``. A target not archived within the window raises
        ``CoderChatError(kind="archive_incomplete", retryable=True)``; other
        REST errors raise at once. An archived chat cannot be resumed.
        """
        primary = self._chat_id or self._last_known_chat_id
        if primary is None and not self._stranded:
            return ArchiveResult(False, None, [])
        self._close_paused_reader()
        targets = list(dict.fromkeys([*self._stranded, *([primary] if primary else [])]))
        async with asyncio.timeout(None if timeout is None else max(0.0, timeout)):
            return await self._archive_targets(primary, targets)

    async def _archive_targets(self, primary: str | None, targets: list[str]) -> ArchiveResult:
        loop = asyncio.get_running_loop()
        t = self._timings
        deadline = loop.time() + t.settle_deadline
        archived: list[str] = []
        for target in targets:
            stopped = await stop_chat(
                self._client,
                target,
                timeout=max(0.001, deadline - loop.time()),
                archive=True,
                poll_interval=t.settle_retry_delay,
            )
            if not stopped.archived:
                why = f"; last error: {stopped.last_error}" if stopped.last_error else ""
                raise CoderChatError(
                    f"chat {target} was not archived within the {t.settle_deadline:g}s window "
                    f"(last status {stopped.status}){why}",
                    kind="archive_incomplete",
                    retryable=True,
                )
            archived.append(target)
            self._stranded.pop(target, None)
            if self._last_known_chat_id == target:
                self._last_known_chat_id = None
        return ArchiveResult(True, primary, archived)

    def _close_paused_reader(self) -> None:
        if self._reader is not None and not self._in_flight:
            self._close_reader_nowait()

    async def aclose(self) -> None:
        """Close the retained stream, wait briefly for best-effort interrupts, close
        the client if this agent built it. Does NOT archive (durable steps must not)."""
        if self._closed:
            return
        self._closed = True
        for reader in {self._reader, self._active_reader} - {None}:
            assert reader is not None
            await reader.aclose()  # a turn still reading ends as a teardown
        self._reader = None
        await self.wait_background(self._timings.interrupt)
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""CoderAgent: one chat session, one turn per :meth:`CoderAgent.generate` call.

A *turn* is a tool loop over *segments* (agent-semantics §3.1): each segment
submits something (the prompt, or client tool results — or nothing, when
:meth:`CoderAgent.follow` re-attaches to a turn another process started), then
reads the chat stream until the run settles. If it settled in ``requires_action`` with client
tool calls, the agent runs the tools locally, posts the results and reads on
— on the SAME retained stream — until a segment ends without client calls.

The agent's parts live in modules named for their jobs: ``agent_options``
(``AgentTimings``, ``AgentHooks``, creation options, the session check),
``agent_session`` (chat, cursor, stranded chats, retained stream),
``segment_runner`` (one segment: submit → read → teardown, with the
per-segment rules), ``segment_reader`` (its read loop), ``follow_target``
(which turn ``follow()`` re-attaches to) and ``agent_cleanup`` (background
interrupts and withdrawals, ``archive()``). This module is the public face and
the turn loop. :meth:`CoderAgent.generate_structured` stays here: two
``generate()`` calls and a pick, which a module of its own would only scatter.

Rules the turn loop enforces (each closes a failure window): attribution —
only events past the turn's cursor count (:mod:`coder_chat.core.translator`),
so a resumed or queued turn never absorbs an earlier run's content or usage;
no interrupt while client tools run — the ``requires_action`` pause is the
only record of a tool effect that may have committed (crash recovery
reconciles it), and a tool whose ledger bookkeeping failed
(``ToolBookkeepingError``) fails the turn with that pause unanswered; the step cap answers (else interrupts) a tool-call pause
instead of leaving the chat in ``requires_action``.

Caller deadlines (``generate(timeout=...)``, ``asyncio.timeout``) and
cancellation propagate unchanged (``TimeoutError`` / ``CancelledError``) after
the best-effort interrupt was fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Self, TypeVar

from pydantic import BaseModel, SecretStr

from coder_chat.agent_cleanup import BackgroundStops, archive_targets
from coder_chat.agent_options import (
    AgentHooks,
    AgentTimings,
    ChatOptions,
    check_session,
)
from coder_chat.agent_session import AgentSession
from coder_chat.core.segment import SegmentKind
from coder_chat.core.text_ledger import Episode
from coder_chat.core.translator import ToolCall
from coder_chat.core.usage import sum_usages
from coder_chat.errors import CoderAgentError, CoderError, ToolBookkeepingError
from coder_chat.events import ToolRun, TransportEmitter, TransportEventHandler
from coder_chat.follow_target import FollowHint, NoTurnToFollowError
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
from coder_chat.segment_runner import SegmentRunner, wire_results
from coder_chat.settings import CoderSettings
from coder_chat.stream import StreamOptions
from coder_chat.tools import (
    ClientTool,
    StructuredOutput,
    ToolContext,
    ToolOutcome,
    tool_definitions,
)

__all__ = [
    "AgentHooks",
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
        hooks: what a durable caller with its own crash recovery sets:
            ``before_send``, ``before_interrupt``, ``leave_landed_runs``
            (:class:`~coder_chat.agent_options.AgentHooks` says which failure
            window each closes). The plain SDK passes none.
        before_interrupt, before_send, leave_landed_runs: the same as
            ``hooks=AgentHooks(...)`` (the old spelling; not with ``hooks=``).
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
        hooks: AgentHooks | None = None,
    ) -> None:
        check_session(chat_id, last_seen_message_id)
        if max_steps < 1:
            raise CoderAgentError("max_steps must be >= 1")
        self._hooks = hooks or AgentHooks()
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
        self._max_steps = max_steps
        self._timings = (timings or AgentTimings()).sanitized()

        self._session = AgentSession(
            chat_id=chat_id, cursor=last_seen_message_id or 0, last_known_chat_id=chat_id
        )
        self._stops = BackgroundStops(client, self._timings, self._hooks)
        self._emitter = TransportEmitter(on_transport_event)
        self._segments = SegmentRunner(
            client,
            self._session,
            self._stops,
            tools=self._tools,
            chat_options=ChatOptions(
                organization_id=organization_id or client.organization_id,
                system_prompt=system_prompt,
                labels=dict(labels) if labels else None,
                workspace_id=workspace_id,
                mcp_server_ids=list(mcp_server_ids) if mcp_server_ids else None,
                model_config_id=model_config_id,
            ),
            request_timeout=(
                float(request_timeout) if request_timeout and request_timeout > 0 else None
            ),
            timings=self._timings,
            stream_options=stream_options,
            hooks=self._hooks,
            emitter=self._emitter,
        )
        self._in_flight = False
        self._closed = False
        self._turn_deadline: float | None = None

    # ------------------------------------------------------------------ state

    @property
    def client(self) -> ChatClient:
        """The REST client (for history reads, recovery, sweeps)."""
        return self._client

    @property
    def chat_id(self) -> str | None:
        """The session's chat (``None`` before the first turn or after a discard)."""
        return self._session.chat_id

    @property
    def last_seen_message_id(self) -> int | None:
        """Resume cursor to checkpoint with ``chat_id`` (``None`` when unknown)."""
        return self._session.cursor or None

    @property
    def last_known_chat_id(self) -> str | None:
        """Cleanup target: survives :meth:`reset_session` and discards until archived."""
        return self._session.last_known_chat_id

    @property
    def stranded_chat_ids(self) -> list[str]:
        """Chats dropped by automatic session discards and not yet archived (oldest first)."""
        return list(self._session.stranded)

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
        (``AgentHooks.leave_landed_runs``) or whose tool pause a failed ledger write
        left unanswered (``ToolBookkeepingError``), else ``None``; reset when a
        turn starts."""
        return self._segments.left_live

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def __repr__(self) -> str:
        return (
            f"CoderAgent(chat_id={self.chat_id!r}, last_seen_message_id="
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
        if self._session.chat_id is None:
            raise CoderAgentError("follow() needs a chat_id (construct the agent with chat_id=)")
        if user_message_id is not None and (
            isinstance(user_message_id, bool)
            or not isinstance(user_message_id, int)
            or user_message_id <= 0
        ):
            raise CoderAgentError("user_message_id must be a positive integer")
        if marker is not None and not marker:
            raise CoderAgentError("marker must be a non-empty string")
        hint = FollowHint(user_message_id, marker)
        return await self._bounded_turn(SegmentKind.FOLLOW, None, timeout, hint)

    async def _bounded_turn(
        self,
        first: SegmentKind,
        prompt: str | None,
        timeout: float | None,
        follow: FollowHint | None = None,
    ) -> GenerateResult:
        self._in_flight = True
        self._segments.left_live = None
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
        self, first: SegmentKind, prompt: str | None, follow: FollowHint | None = None
    ) -> GenerateResult:
        steps: list[StepResult] = []
        client_calls: list[ClientToolCall] = []
        outcomes: list[ToolOutcome] = []
        user_message_id: int | None = None
        chat_id: str | None = None
        created_here = self._session.chat_id is None
        closed: set[Episode] = set()
        kind = first
        while True:
            try:
                seg = await self._segments.run(
                    kind,
                    prompt=prompt,
                    results=outcomes,
                    follow=follow,
                    created_turn=created_here,
                    closed_episodes=closed,
                    turn_deadline=self._turn_deadline,
                )
            except BaseException:
                self._session.close_reader_nowait()
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
                    self._session.close_reader_nowait()
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
        self._session.close_reader_nowait()
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
            started = time.monotonic()
            try:
                result = await tool.run(call.input, ctx)
            except ToolBookkeepingError:
                self._tool_ran(call, chat_id, started, "failed-turn", None)
                raise
            # (Cancelled or another escape: no line — the turn's own end says it.)
            self._tool_ran(
                call, chat_id, started, "error" if result.is_error else "ok", result.error
            )
            return result

        # Every sibling runs to its end before a failure propagates: a tool left
        # running past the turn would race the next attempt's re-drive of its call.
        done = await asyncio.gather(*(run_one(c) for c in calls), return_exceptions=True)
        for item in done:
            if isinstance(item, ToolBookkeepingError):
                # A ledger write failed around an effect (ClientTool.run lets only this
                # through): the pause stays unanswered and uninterrupted — recovery
                # finishes the call from the ledger under the same key — so the run is
                # left live for the caller's recovery, as after a landed send.
                self._segments.left_live = chat_id
        for item in done:
            if isinstance(item, BaseException):
                raise item
        return [item for item in done if not isinstance(item, BaseException)]

    def _tool_ran(
        self,
        call: ToolCall,
        chat_id: str,
        started: float,
        outcome: Literal["ok", "error", "failed-turn"],
        error: str | None,
    ) -> None:
        """One event per executed call (the run's log shows it): name, time and outcome
        — never the arguments or the output."""
        took = (time.monotonic() - started) * 1000
        self._emitter.emit(
            lambda: ToolRun(
                chat_id=chat_id,
                tool_call_id=call.tool_call_id,
                tool_name=call.tool_name,
                duration_ms=took,
                outcome=outcome,
                error=error,
            )
        )

    async def _wind_down(self, chat_id: str, outcomes: list[ToolOutcome]) -> None:
        """The step cap hit on a tool-call step: answer the pause or stop the run.

        Leaving it in ``requires_action`` would strand the chat (follow-ups queue
        forever), so the recorded outcomes are submitted (bounded), falling back
        to an interrupt.
        """
        session = self._session
        session.close_reader_nowait()
        fresh = [o for o in outcomes if o.tool_call_id not in session.submitted]
        try:
            if fresh:
                await self._client.submit_tool_results(
                    chat_id, wire_results(fresh), timeout=self._timings.wind_down
                )
                session.submitted.update(o.tool_call_id for o in fresh)
                return
        except (CoderError, TimeoutError, OSError) as exc:
            _log.debug("wind-down submit failed: %s", type(exc).__name__)
        if not await self._stops.journal_interrupt(chat_id):
            return
        with contextlib.suppress(CoderError, TimeoutError, OSError):
            await self._client.interrupt_chat(chat_id, timeout=self._timings.wind_down)

    # ------------------------------------------------------------------ session ops

    async def wait_background(self, timeout: float | None = 5.0) -> None:
        """Wait for fire-and-forget interrupts/withdrawals (bounded)."""
        await self._stops.wait(timeout)

    def reset_session(self) -> None:
        """Forget the chat: ``chat_id`` → None, cursor cleared, retained stream closed.

        ``last_known_chat_id`` is kept (cleanup target); nothing is stranded.
        """
        self._session.reset()

    def resume(self, chat_id: str, *, last_seen_message_id: int | None = None) -> None:
        """Point the session at an existing chat (no I/O): what constructing the agent
        with ``chat_id`` does, for an agent that already exists — e.g. one whose
        checkpointed chat was archived, when recovery finds the step's chat elsewhere.
        The previous session is reset first (:meth:`reset_session`)."""
        if chat_id is None:
            raise CoderAgentError("chat_id must be a non-empty string")
        check_session(chat_id, last_seen_message_id)
        self.reset_session()
        self._session.chat_id = self._session.last_known_chat_id = chat_id
        self._session.cursor = last_seen_message_id or 0

    async def interrupt(self, *, timeout: float | None = None) -> InterruptResult:
        """Interrupt the session's chat (or the last known one).

        Resolves on acknowledgement; the run keeps winding down briefly. A chat
        with no live run answers 409 (``CoderApiError``).
        """
        target = self._session.chat_id or self._session.last_known_chat_id
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
        session = self._session
        primary = session.chat_id or session.last_known_chat_id
        if primary is None and not session.stranded:
            return ArchiveResult(False, None, [])
        self._close_paused_reader()
        targets = list(dict.fromkeys([*session.stranded, *([primary] if primary else [])]))
        async with asyncio.timeout(None if timeout is None else max(0.0, timeout)):
            return await archive_targets(self._client, session, self._timings, primary, targets)

    def _close_paused_reader(self) -> None:
        if self._session.reader is not None and not self._in_flight:
            self._session.close_reader_nowait()

    async def aclose(self) -> None:
        """Close the retained stream, wait briefly for best-effort interrupts, close
        the client if this agent built it. Does NOT archive (durable steps must not)."""
        if self._closed:
            return
        self._closed = True
        session = self._session
        for reader in {session.reader, session.active_reader} - {None}:
            assert reader is not None
            await reader.aclose()  # a turn still reading ends as a teardown
        session.reader = None
        await self.wait_background(self._timings.interrupt)
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

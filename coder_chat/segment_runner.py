"""One segment of a turn, as I/O: submit, read until the run settles, tear down.

A segment (agent-semantics §3.1) submits something — the prompt, client tool
results, or nothing when a follow re-attaches — then reads the chat stream
until the run settles (:func:`coder_chat.segment_reader.read_until_settled`).
How it ends — interrupt, withdraw, keep the stream, strand — is decided by the
pure :func:`coder_chat.core.segment.teardown`; this module records what
happened (:class:`SegmentRun`), carries the decision out, maps failures to the
agent's error types and emits ``segment:start`` / ``segment:settle``.

Rules it enforces (each closes a failure window):

* per-segment ``request_timeout`` covering REST, stream, redial backoff and
  recovery fetches → ``CoderChatError(kind="timeout", retryable=True)``;
* a segment that ends without a terminal status fires one best-effort
  interrupt of its own chat (never of a promoted successor; a still-queued
  prompt is withdrawn instead of interrupting someone else's run) — unless the
  caller's ``leave_landed_runs`` keeps a transiently failed run live;
* a ``CoderStreamError`` on a chat this turn created strands the chat and
  discards the session; its ``retryable`` verdict is decided here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coder_chat.agent_cleanup import BackgroundStops
from coder_chat.agent_options import AgentHooks, AgentTimings, ChatOptions
from coder_chat.agent_session import AgentSession
from coder_chat.core.follow import FollowPlan
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
from coder_chat.core.translator import QueuedGate, TurnTranslator, pending_client_calls
from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderChatError,
    CoderStreamError,
    is_transient,
)
from coder_chat.events import SegmentSettle, SegmentStart, TransportEmitter
from coder_chat.follow_target import FollowHint, find_turn_to_follow
from coder_chat.models import ChatInputPart, CreateChatMessageRequest
from coder_chat.models import ToolResult as WireToolResult
from coder_chat.rest import ChatClient
from coder_chat.segment_reader import read_until_settled
from coder_chat.stream import ChatStreamReader, StreamOptions
from coder_chat.tools import ClientTool, ToolOutcome

__all__ = ["Segment", "SegmentRunner", "TornDown", "wire_results"]


@dataclass(slots=True)
class Segment:
    """Outcome of one segment (internal)."""

    translator: TurnTranslator
    chat_id: str
    user_message_id: int | None
    follow: FollowPlan | None = None


@dataclass(slots=True)
class SegmentRun:
    """One segment's progress as its I/O shell records it (teardown reads it)."""

    state: SegmentState
    tr: TurnTranslator | None = None
    reader: ChatStreamReader | None = None
    user_message_id: int | None = None
    stream_failed: bool = False
    anchor_on_first_user: bool | None = None
    follow: FollowPlan | None = None


class TornDown(CoderAgentError):
    """The agent was closed while a turn was reading its stream (a teardown)."""


def read_state(tr: TurnTranslator) -> ReadState:
    return ReadState(
        reached_terminal=tr.reached_terminal,
        gated=tr.gated,
        queued_id=tr.queued_id,
        paused_for_tools=tr.terminal_status == "requires_action"
        and bool(tr.client_calls)
        and not tr.promoted,
    )


def wire_results(outcomes: Sequence[ToolOutcome]) -> list[WireToolResult]:
    return [
        WireToolResult(tool_call_id=o.tool_call_id, output=o.output, is_error=o.is_error)
        for o in outcomes
    ]


class SegmentRunner:
    """Runs an agent's segments against its session (internal to the agent)."""

    def __init__(
        self,
        client: ChatClient,
        session: AgentSession,
        stops: BackgroundStops,
        *,
        tools: Mapping[str, ClientTool[Any]],
        chat_options: ChatOptions,
        request_timeout: float | None,
        timings: AgentTimings,
        stream_options: StreamOptions | None,
        hooks: AgentHooks,
        emitter: TransportEmitter,
    ) -> None:
        self._client = client
        self._session = session
        self._stops = stops
        self._tools = tools
        self._chat_options = chat_options
        self._request_timeout = request_timeout
        self._timings = timings
        self._stream_options = stream_options
        self._hooks = hooks
        self._emitter = emitter
        self._segment_no = 0
        #: The chat whose live run a transient failure left alone (``leave_landed_runs``).
        self.left_live: str | None = None

    async def run(
        self,
        kind: SegmentKind,
        *,
        prompt: str | None = None,
        results: Sequence[ToolOutcome] = (),
        follow: FollowHint | None = None,
        created_turn: bool,
        closed_episodes: set[Episode],
        turn_deadline: float | None,
    ) -> Segment:
        """Run one segment; emits ``segment:start`` and exactly one ``segment:settle``."""
        self._segment_no += 1
        seg_no = self._segment_no
        started = time.perf_counter()
        start_chat = self._session.chat_id
        self._emitter.emit(lambda: SegmentStart(segment=seg_no, chat_id=start_chat))
        run = SegmentRun(SegmentState(chat_id=self._session.chat_id))
        ending: Ending = "teardown"
        error_info: dict[str, str] | None = None
        failure: BaseException | None = None
        try:
            await self._run_segment(run, kind, prompt, results, follow, closed_episodes)
            assert run.tr is not None and run.state.chat_id is not None
            ending = "clean"
            return Segment(run.tr, run.state.chat_id, run.user_message_id, run.follow)
        except asyncio.CancelledError:
            ending = "failure"
            if turn_deadline is not None and asyncio.get_running_loop().time() >= turn_deadline:
                error_info = {"name": "TimeoutError", "message": "turn timeout"}
            else:
                error_info = {"name": "CancelledError", "message": "the turn was cancelled"}
            raise
        except TornDown:
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
        run: SegmentRun,
        kind: SegmentKind,
        prompt: str | None,
        results: Sequence[ToolOutcome],
        follow: FollowHint | None,
        closed_episodes: set[Episode],
    ) -> None:
        """Submit, then read until the run settles; errors mapped to the agent's types."""
        session = self._session
        deadline = asyncio.timeout(self._request_timeout)  # None: unbounded
        try:
            async with deadline:
                after_id, gate = await self._submit(run, kind, prompt, results, follow)
                chat_id = run.state.chat_id
                assert chat_id is not None
                session.last_known_chat_id = chat_id
                tr = run.tr = TurnTranslator(
                    client_tool_names=self._tools.keys(),
                    cursor=after_id,
                    submitted_tool_call_ids=session.submitted,
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
                    raise TornDown("the turn was torn down: the agent was closed mid-turn")
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
            if isinstance(exc, CoderChatError | TornDown) or run.reader is None:
                raise
            # An unparseable frame: the stream failed mid-turn.
            raise CoderChatError(
                "Coder chat stream failed mid-turn", kind="stream_closed", retryable=True
            ) from exc

    async def _submit(
        self,
        run: SegmentRun,
        kind: SegmentKind,
        prompt: str | None,
        results: Sequence[ToolOutcome],
        follow: FollowHint | None = None,
    ) -> tuple[int, QueuedGate | None]:
        """The REST phase: returns the stream cursor and the queue gate (if queued)."""
        session = self._session
        if kind is SegmentKind.FOLLOW:
            # Nothing is sent: read history once, then follow from the live step.
            assert session.chat_id is not None and follow is not None
            plan = await find_turn_to_follow(
                self._client, session.chat_id, follow, session.cursor or None, self._tools.keys()
            )
            run.follow = plan
            run.user_message_id = plan.user_message_id
            run.anchor_on_first_user = False
            session.submitted.update(plan.answered_call_ids)
            run.state = run.state.adopted(session.chat_id)
            return plan.cursor, plan.queued
        if session.chat_id is not None and session.cursor == 0:
            page = await self._client.get_messages(session.chat_id, limit=1)
            session.cursor = page.messages[0].id if page.messages else 0
        after_id = session.cursor
        if kind is SegmentKind.RESULTS:
            if session.chat_id is None:
                raise CoderChatError("cannot submit tool results before a chat exists")
            chat_id = session.chat_id
            fresh = [o for o in results if o.tool_call_id not in session.submitted]
            if fresh:
                run.state = run.state.sending()
                await self._client.submit_tool_results(chat_id, wire_results(fresh))
                session.submitted.update(o.tool_call_id for o in fresh)
            run.state = run.state.landed(chat_id)
            return after_id, None
        assert prompt is not None
        content = [ChatInputPart.text_part(prompt)]
        if self._hooks.before_send is not None:
            # Before the state says "sending": a refusal here sent nothing.
            await self._hooks.before_send(session.chat_id)
        run.state = run.state.sending()
        if session.chat_id is None:
            chat = await self._client.create_chat(
                self._chat_options.create_request(content, list(self._tools.values()))
            )
            session.chat_id = chat.id
            session.assigned_workspace = chat.workspace_id
            session.assigned_mcp = list(chat.mcp_server_ids)
            run.state = run.state.landed(chat.id, created=True)
            return after_id, None
        chat_id = session.chat_id
        resp = await self._client.create_message(
            chat_id,
            CreateChatMessageRequest(
                content=content, model_config_id=self._chat_options.model_config_id
            ),
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

    def _end_segment(
        self,
        run: SegmentRun,
        ending: Ending,
        created_turn: bool,
        failure: BaseException | None = None,
    ) -> None:
        """Apply :func:`coder_chat.core.segment.teardown` to the stream and the chat."""
        session = self._session
        tr, reader = run.tr, run.reader
        session.active_reader = None
        if tr is not None:
            session.cursor = max(session.cursor, tr.max_message_id)
        decision = teardown(
            run.state,
            read_state(tr) if tr is not None else None,
            ending=ending,
            stream_failed=run.stream_failed,
            created_turn=created_turn,
        )
        if decision.keep_stream and reader is not None:
            reader.pause()
            session.reader = reader
        else:
            if reader is not None:
                reader.close_nowait()
            if session.reader is not None and session.reader is not reader:
                session.reader.close_nowait()
            session.reader = None
        chat_id = run.state.chat_id
        if chat_id is None:
            return
        if decision.strand:
            session.stranded[chat_id] = None
        if (
            decision.stop is Stop.INTERRUPT
            and self._hooks.leave_landed_runs
            and is_transient(failure)
        ):
            # The submission went out and only its answer (or a read) failed: the
            # run may be this turn's own live continuation. Left for recovery to
            # follow — cutting it would repeat its committed tool calls.
            self.left_live = chat_id
        elif decision.stop is Stop.INTERRUPT:
            self._stops.fire_interrupt(chat_id)
        elif decision.stop is Stop.WITHDRAW and decision.withdraw_id is not None:
            self._stops.fire_withdraw(chat_id, decision.withdraw_id)
        if decision.strand:
            session.discard(chat_id)

    def _stream_retry_verdict(self, created_chat: bool) -> tuple[bool, str | None]:
        if not created_chat:
            return False, "not retryable: the chat existed before this call"
        if self._chat_options.workspace_id or self._session.assigned_workspace:
            return False, "not retryable: the chat has a workspace"
        if self._chat_options.mcp_server_ids or self._session.assigned_mcp:
            return False, "not retryable: the chat has MCP servers"
        return True, None

    def _acquire_reader(self, chat_id: str, after_id: int, *, resume: bool) -> ChatStreamReader:
        session = self._session
        retained = session.reader
        if resume and retained is not None and retained.reusable_for(chat_id):
            retained.resume()
            session.active_reader = retained
            return retained
        if retained is not None:
            retained.close_nowait()
        session.reader = None
        reader = ChatStreamReader(
            self._client, chat_id, after_id or None, options=self._stream_options
        )
        reader.start()
        session.active_reader = reader
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
            submitted_tool_call_ids=self._session.submitted,
        )
        return (turn, calls) if calls else None

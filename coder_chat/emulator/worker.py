"""The scripted model: one worker task per running chat.

The worker plays chatd's generation loop for a chat: it picks the turn's script, streams each
step's parts as ``message_part`` previews, fails/retries attempts as scripted, commits each
step as an assistant message, enters ``requires_action`` for client tool calls, winds an
interrupt down, and finishes the turn. Every state change goes through the core's
transitions (``Core.apply``), so the worker never decides a status itself.

The worker sits below ``core.py`` (the core builds it); what it needs from the core is
spelled out by ``TurnHost`` here, so this module never imports ``core.py``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import statemachine as sm
from .config import CONTEXT_LIMIT, Config
from .script import (
    Failure,
    Reasoning,
    Script,
    ScriptedToolCall,
    ScriptStep,
    ServerToolCall,
    Sleep,
    Text,
    parse_directive,
)
from .statemachine import ExecView, Outcome
from .store import ChatRec, Ids, MsgRec, TurnState, User, rfc3339


class TurnHost(Protocol):
    """What the worker needs from the deployment that runs it (``core.Core``).

    Reads: the config, the chats, the default script, the id sequences, the clock and
    the state machine's view of a chat. Writes go only through ``apply`` (a transition)
    and ``commit_rows`` (one step's rows in one transaction); ``notify``/``watch``/``log``
    publish what happened.
    """

    cfg: Config
    chats: dict[str, ChatRec]
    default_script: Script | None
    ids: Ids

    def now(self) -> float: ...

    def log(self, kind: str, chat_id: str | None = None, **details: Any) -> None: ...

    def view(self, chat: ChatRec) -> ExecView: ...

    def notify(self, chat: ChatRec) -> None: ...

    def watch(self, chat: ChatRec, kind: str, **extra: Any) -> None: ...

    def commit_rows(
        self, chat: ChatRec, rows: list[tuple[dict[str, Any], str]]
    ) -> list[MsgRec]: ...

    def tool_result_row(
        self,
        chat: ChatRec,
        call_id: str,
        name: str,
        result: Any,
        is_error: bool,
        created_by: str | None,
    ) -> dict[str, Any]: ...

    def apply(
        self,
        chat: ChatRec,
        outcome: Outcome,
        *,
        content: list[dict[str, Any]] | None = None,
        user: User | None = None,
        queued_id: int | None = None,
        results: list[dict[str, Any]] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]: ...


@dataclass
class Partial:
    """What the current attempt has streamed so far (for an interrupted commit)."""

    reasoning: str = ""
    text: str = ""
    order: list[str] = field(default_factory=list)  # "reasoning" | "text" | call ids
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)


class Worker:
    """Runs scripted turns for every chat of one core (one asyncio task per chat)."""

    def __init__(self, core: TurnHost) -> None:
        self.core = core
        self.running_turns = 0
        self.closed = False
        limit = core.cfg.max_concurrent_root_chats
        # Capacity: chats beyond the limit stay running with queued_for_capacity.
        self._capacity: asyncio.Semaphore | None = asyncio.Semaphore(limit) if limit else None

    def ensure(self, chat: ChatRec) -> None:
        """Start the chat's worker task unless one is already running."""
        if chat.worker is None and not self.closed:
            chat.worker = asyncio.get_running_loop().create_task(self._worker(chat))

    async def aclose(self) -> None:
        """Cancel every worker task."""
        self.closed = True
        tasks = [c.worker for c in self.core.chats.values() if c.worker is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _select_script(self, chat: ChatRec) -> Script:
        if chat.next_scripts:
            return chat.next_scripts.pop(0)
        last_user = next(
            (m for m in reversed(chat.live_messages()) if m.wire["role"] == "user"), None
        )
        text = _text_of(last_user.wire) if last_user else ""
        script, err = parse_directive(text)
        if script is not None:
            return script
        if err is not None:
            return Script.fatal(err, kind="config", status_code=400)
        if chat.chat_script is not None:
            return chat.chat_script
        if self.core.default_script is not None:
            return self.core.default_script
        reply = f"Echo: {text}" if text else "Echo: (no text)"
        return Script((ScriptStep((Text(reply),)),))

    async def _worker(self, chat: ChatRec) -> None:
        acquired = False
        turn_open = False
        try:
            if self._capacity is not None and chat.parent_chat_id is None:
                # Waiting for a slot; an interrupt meanwhile winds down without one.
                while chat.status == sm.RUNNING and not chat.interrupt_flag:
                    if not self._capacity.locked():
                        await self._capacity.acquire()
                        acquired = True
                        break
                    if not chat.queued_for_capacity:
                        chat.queued_for_capacity = True
                        self.core.notify(chat)
                    await self._pause(chat, 0.05)
                if chat.queued_for_capacity:
                    chat.queued_for_capacity = False
                    self.core.notify(chat)
            chat.owned = True
            while chat.status in (sm.RUNNING, sm.INTERRUPTING):
                if chat.interrupt_flag or chat.status == sm.INTERRUPTING:
                    await self._wind_down(chat)
                    if turn_open:
                        self._turn_end(chat, "interrupted")
                        turn_open = False
                    self._finish_interruption(chat)
                    continue
                if chat.turn is None:
                    chat.turn = TurnState(self._select_script(chat))
                if not turn_open:
                    self._turn_start(chat)
                    turn_open = True
                step = self._next_step(chat)
                if step is None:
                    self._turn_end(chat, "completed")
                    turn_open = False
                    chat.turn = None
                    self.core.apply(chat, sm.finish_turn(self.core.view(chat)))
                    continue
                result = await self._run_step(chat, step)
                # The commit and the next transition are separate transactions: let
                # subscribers sync in between (the usual two-sync shape, spec §3.5).
                await asyncio.sleep(0)
                if result == "requires_action" and self._enter_requires_action(chat):
                    self._turn_end(chat, "requires_action")
                    return
                if result == "error":
                    self._turn_end(chat, "error")
                    chat.turn = None
                    return
                # "committed" or "interrupted": loop decides
        except asyncio.CancelledError:
            if turn_open:
                self._turn_end(chat, "abandoned")
            raise
        finally:
            if chat.worker is asyncio.current_task():
                chat.worker = None
                chat.owned = False
            if acquired and self._capacity is not None:
                self._capacity.release()

    def _enter_requires_action(self, chat: ChatRec) -> bool:
        """Second transaction after a tool-call commit; False if an interrupt won the race."""
        assert chat.turn is not None
        pending, chat.turn.pending_enter = chat.turn.pending_enter, []
        if chat.status == sm.RUNNING and not chat.interrupt_flag:
            chat.pending_calls = pending
            self.core.apply(chat, sm.enter_requires_action(self.core.view(chat)))
            self.core.watch(chat, "action_required", tool_calls=[dict(c) for c in pending])
            return True
        rows = [
            (
                self.core.tool_result_row(
                    chat, c["tool_call_id"], c["tool_name"], sm.REASON_INTERRUPT, True, None
                ),
                "both",
            )
            for c in pending
        ]
        self.core.commit_rows(chat, rows)
        self.core.notify(chat)
        return False

    def _turn_start(self, chat: ChatRec) -> None:
        self.running_turns += 1
        self.core.log("turn_start", chat.id, running=self.running_turns)

    def _turn_end(self, chat: ChatRec, outcome: str) -> None:
        self.running_turns -= 1
        self.core.log("turn_end", chat.id, outcome=outcome, running=self.running_turns)

    def _next_step(self, chat: ChatRec) -> ScriptStep | None:
        turn = chat.turn
        assert turn is not None
        step = turn.next_step()
        if step is not None:
            turn.step_idx += 1
            return step
        if turn.follow_up_pending:
            turn.follow_up_pending = False
            return ScriptStep((Text(self._results_summary(chat)),))
        return None

    def _results_summary(self, chat: ChatRec) -> str:
        # The tool rows after the last assistant message.
        results: list[str] = []
        for m in reversed(chat.live_messages()):
            if m.wire["role"] == "assistant":
                break
            if m.wire["role"] == "tool":
                for p in m.wire.get("content") or []:
                    if p.get("type") == "tool-result":
                        results.append(f"{p['tool_name']} → {json.dumps(p['result'])}")
        return "Results: " + "; ".join(reversed(results)) if results else "Results: (none)"

    async def _wind_down(self, chat: ChatRec) -> None:
        # The worker needs a moment to notice the interrupt and commit; during this window
        # archive keeps answering 409 (spec §1.9).
        if self.core.cfg.interrupt_wind_down > 0:
            await asyncio.sleep(self.core.cfg.interrupt_wind_down)

    def _finish_interruption(self, chat: ChatRec) -> None:
        chat.interrupt_flag = False
        chat.turn = None
        self.core.apply(chat, sm.finish_interruption(self.core.view(chat)))

    async def _pause(self, chat: ChatRec, seconds: float) -> bool:
        """Sleep, waking early on interrupt; True when interrupted."""
        if chat.interrupt_flag:
            return True
        if seconds <= 0.02:
            await asyncio.sleep(seconds)
            return chat.interrupt_flag
        assert chat.wake is not None
        chat.wake.clear()
        if chat.interrupt_flag:
            return True
        chat.sleeping = True
        try:
            await asyncio.wait_for(chat.wake.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            chat.sleeping = False
        return chat.interrupt_flag

    def _emit(self, chat: ChatRec, part: dict[str, Any], role: str = "assistant") -> None:
        hv, att = chat.episode
        ev = {
            "type": "message_part",
            "chat_id": chat.id,
            "message_part": {
                "role": role,
                "part": part,
                "history_version": hv,
                "generation_attempt": att,
                "seq": len(chat.parts) + 1,
            },
        }
        chat.buffers.setdefault(chat.episode, []).append(ev)
        self.core.notify(chat)

    def _begin_attempt(self, chat: ChatRec) -> None:
        chat.generation_attempt += 1
        chat.retry = None
        chat.buffers[chat.episode] = []
        # Keep only recent episodes; older ones are garbage-collected (spec: ≥15 s later).
        for ep in list(chat.buffers)[:-3]:
            del chat.buffers[ep]
            chat.retired.discard(ep)
        self.core.notify(chat)

    async def _run_step(self, chat: ChatRec, step: ScriptStep) -> str:
        attempts: list[Failure | None] = [*step.failures, None]
        for attempt_no, failure in enumerate(attempts, start=1):
            self._begin_attempt(chat)
            partial = Partial()
            limit = failure.after_parts if failure else None
            interrupted = await self._stream(chat, step, partial, limit)
            if interrupted:
                self._commit_partial(chat, partial if failure is None else Partial())
                return "interrupted"
            if failure is not None:
                chat.retired.add(chat.episode)
            if failure is not None and failure.retryable:
                delay = failure.delay_ms / 1000
                chat.retry = {
                    "attempt": attempt_no,
                    "delay_ms": failure.delay_ms,
                    "error": failure.message,
                    "kind": failure.kind,
                    "retrying_at": rfc3339(self.core.now() + delay),
                }
                if failure.provider:
                    chat.retry["provider"] = failure.provider
                if failure.status_code is not None:
                    chat.retry["status_code"] = failure.status_code
                chat.retry_version += 1
                self.core.log("retry", chat.id, attempt=attempt_no)
                self.core.notify(chat)
                if await self._pause(chat, delay):
                    chat.retry = None
                    self._commit_partial(chat, Partial())
                    return "interrupted"
                continue
            if failure is not None:
                err: dict[str, Any] = {
                    "message": failure.message,
                    "kind": failure.kind,
                    "retryable": False,
                }
                if failure.provider:
                    err["provider"] = failure.provider
                if failure.status_code is not None:
                    err["status_code"] = failure.status_code
                self.core.apply(chat, sm.finish_error(self.core.view(chat)), error=err)
                return "error"
            delay = step.commit_delay or self.core.cfg.commit_delay
            if delay:
                await asyncio.sleep(delay)
            return self._commit_step(chat, step, partial)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _stream(
        self, chat: ChatRec, step: ScriptStep, partial: Partial, limit: int | None
    ) -> bool:
        """Emit the step's parts; True when interrupted. Stops after ``limit`` parts."""
        emitted = 0

        def budget() -> bool:
            return limit is None or emitted < limit

        for p in step.parts:
            if not budget():
                return False
            if isinstance(p, Sleep):
                if await self._pause(chat, p.seconds):
                    return True
            elif isinstance(p, Text | Reasoning):
                kind = "text" if isinstance(p, Text) else "reasoning"
                n = p.deltas or self.core.cfg.delta_count
                delay = self.core.cfg.delta_delay if p.delay is None else p.delay
                if kind not in partial.order:
                    partial.order.append(kind)
                for chunk in _chunks(p.text, n):
                    if not budget():
                        return False
                    self._emit(chat, {"type": kind, "text": chunk})
                    emitted += 1
                    if kind == "text":
                        partial.text += chunk
                    else:
                        partial.reasoning += chunk
                    if await self._pause(chat, delay):
                        return True
            else:
                call_id = p.id or self.core.ids.tool_call()
                provider = isinstance(p, ServerToolCall)
                args_text = json.dumps(p.args)
                base: dict[str, Any] = {
                    "type": "tool-call",
                    "tool_call_id": call_id,
                    "tool_name": p.name,
                }
                if provider:
                    base["provider_executed"] = True
                for chunk in _chunks(args_text, 2):
                    if not budget():
                        return False
                    self._emit(chat, {**base, "args_delta": chunk})
                    emitted += 1
                    if await self._pause(chat, self.core.cfg.delta_delay):
                        return True
                full = {**base, "args": p.args, "created_at": rfc3339(self.core.now())}
                self._emit(chat, full)
                emitted += 1
                partial.order.append(call_id)
                partial.calls[call_id] = {"spec": p, "part": full, "result": None}
                if isinstance(p, ServerToolCall):
                    res = {
                        "type": "tool-result",
                        "tool_call_id": call_id,
                        "tool_name": p.name,
                        "result": p.result,
                        "provider_executed": True,
                    }
                    if p.is_error:
                        res["is_error"] = True
                    if await self._pause(chat, self.core.cfg.delta_delay):
                        return True
                    self._emit(chat, res, role="tool")
                    emitted += 1
                    partial.calls[call_id]["result"] = res
        return False

    def _assistant_content(self, partial: Partial) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = []
        for key in partial.order:
            if key == "text":
                content.append({"type": "text", "text": partial.text})
            elif key == "reasoning":
                content.append({"type": "reasoning", "text": partial.reasoning})
            else:
                c = partial.calls[key]
                part = {k: v for k, v in c["part"].items() if k != "args_delta"}
                content.append(part)
                if c["result"] is not None:
                    content.append(dict(c["result"]))
        return content

    def _usage(self, chat: ChatRec, partial: Partial, step: ScriptStep) -> dict[str, int]:
        if step.usage:
            u = {
                "input_tokens": 0,
                "output_tokens": 0,
                "reasoning_tokens": 0,
                "cache_creation_tokens": 0,
                "cache_read_tokens": 0,
                **step.usage,
            }
            u.setdefault("total_tokens", u["input_tokens"] + u["output_tokens"])
            u.setdefault("context_limit", CONTEXT_LIMIT)
            return u
        hist = sum(len(json.dumps(m.wire.get("content"))) for m in chat.live_messages())
        inp = max(1, hist // 4)
        out = max(1, (len(partial.text) + len(partial.reasoning)) // 4 + 2 * len(partial.calls))
        return {
            "input_tokens": inp,
            "output_tokens": out,
            "total_tokens": inp + out,
            "reasoning_tokens": len(partial.reasoning) // 4,
            "cache_creation_tokens": 0,
            "cache_read_tokens": 0,
            "context_limit": CONTEXT_LIMIT,
        }

    def _commit_step(self, chat: ChatRec, step: ScriptStep, partial: Partial) -> str:
        wire = {
            "chat_id": chat.id,
            "model_config_id": chat.model_config_id,
            "created_at": rfc3339(self.core.now()),
            "role": "assistant",
            "content": self._assistant_content(partial),
            "usage": self._usage(chat, partial, step),
        }
        rows: list[tuple[dict[str, Any], str]] = [(wire, "both")]
        pending: list[dict[str, Any]] = []
        for key in partial.order:
            c = partial.calls.get(key)
            if c is None:
                continue
            spec = c["spec"]
            if isinstance(spec, ScriptedToolCall):
                if spec.name in chat.dynamic_tools:
                    pending.append(
                        {"tool_call_id": key, "tool_name": spec.name, "args": json.dumps(spec.args)}
                    )
                else:
                    # Not a declared dynamic tool: runs as an (unknown) built-in and fails.
                    rows.append(
                        (
                            self.core.tool_result_row(
                                chat,
                                key,
                                spec.name,
                                {"error": f'tool "{spec.name}" not found'},
                                True,
                                None,
                            ),
                            "both",
                        )
                    )
        self.core.commit_rows(chat, rows)
        self.core.notify(chat)
        if (
            chat.turn is not None
            and step is chat.turn.script.steps[-1]
            and (
                pending
                or any(isinstance(c["spec"], ScriptedToolCall) for c in partial.calls.values())
            )
        ):
            chat.turn.follow_up_pending = True
        if pending and chat.turn is not None:
            chat.turn.pending_enter = pending
            return "requires_action"
        return "committed"

    def _commit_partial(self, chat: ChatRec, partial: Partial) -> None:
        """Commit what an interrupted attempt produced; open calls get synthetic results."""
        if not partial.order:
            return
        content = self._assistant_content(partial)
        wire = {
            "chat_id": chat.id,
            "model_config_id": chat.model_config_id,
            "created_at": rfc3339(self.core.now()),
            "role": "assistant",
            "content": content,
            "usage": self._usage(chat, partial, ScriptStep()),
        }
        rows: list[tuple[dict[str, Any], str]] = [(wire, "both")]
        for key, c in partial.calls.items():
            spec = c["spec"]
            if isinstance(spec, ServerToolCall) and c["result"] is None:
                content.append(
                    {
                        "type": "tool-result",
                        "tool_call_id": key,
                        "tool_name": spec.name,
                        "result": {
                            "error": "tool call was interrupted before it produced a result"
                        },
                        "is_error": True,
                        "provider_executed": True,
                    }
                )
            elif isinstance(spec, ScriptedToolCall):
                rows.append(
                    (
                        self.core.tool_result_row(
                            chat, key, spec.name, sm.REASON_INTERRUPT, True, None
                        ),
                        "both",
                    )
                )
        self.core.commit_rows(chat, rows)
        self.core.notify(chat)


def _text_of(wire: dict[str, Any]) -> str:
    return "\n".join(
        p.get("text", "") for p in wire.get("content") or [] if p.get("type") == "text"
    )


def _chunks(text: str, n: int) -> list[str]:
    """Split ``text`` into ``n`` (or fewer, never empty unless text is) contiguous pieces."""
    if not text:
        return [""]
    n = max(1, min(n, len(text)))
    size, rem = divmod(len(text), n)
    out, i = [], 0
    for k in range(n):
        j = i + size + (1 if k < rem else 0)
        out.append(text[i:j])
        i = j
    return out


__all__ = ["Partial", "Worker"]

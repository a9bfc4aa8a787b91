"""The emulated chatd daemon: chats, transitions, the scripted worker, stream/watch fan-out.

Runs on one asyncio loop; every method that mutates state is synchronous (one "database
transaction") except the worker coroutines. Transitions are decided by the pure
``statemachine`` module; this module applies their effects and notifies subscribers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import statemachine as sm
from .faults import FaultState
from .script import (
    ClientToolCall,
    Failure,
    Reasoning,
    Script,
    ServerToolCall,
    Sleep,
    Step,
    Text,
    parse_directive,
)
from .statemachine import Effect, EffectKind, ExecView, Outcome, Refused
from .store import ChatRec, Ids, MsgRec, TurnState, User, new_uuid, rfc3339

DEFAULT_MODEL_CONFIG_ID = "00000000-0000-4000-8000-00000000c0de"
CONTEXT_LIMIT = 200_000


@dataclass
class Config:
    """Emulator knobs; defaults are the real server's where one exists."""

    requires_action_timeout: float = 300.0
    ping_interval: float = 15.0
    ping_timeout: float = 15.0
    queue_cap: int = 20
    delta_count: int = 5
    delta_delay: float = 0.005
    commit_delay: float = 0.0
    interrupt_wind_down: float = 0.02
    max_concurrent_root_chats: int | None = None
    clock: Callable[[], float] = time.time
    log_requests: bool = True
    max_event_log: int = 100_000
    # Newest builds stamp a promoted queue head with the id of the queue entry it came
    # from; older ones do not. Both exist in the field, so clients must handle both:
    # tests switch this off to exercise the content heuristic.
    stamp_queued_message_id: bool = True
    # AI Gateway provider names → surface kind ("openai" | "anthropic"); None: both
    # default names (see aibridge.py).
    aibridge_providers: dict[str, str] | None = None


@dataclass
class FileRec:
    """An uploaded chat file."""

    id: str
    owner_id: str
    organization_id: str
    media_type: str
    name: str
    data: bytes
    created_at: float


@dataclass
class Partial:
    """What the current attempt has streamed so far (for an interrupted commit)."""

    reasoning: str = ""
    text: str = ""
    order: list[str] = field(default_factory=list)  # "reasoning" | "text" | call ids
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)


class WatchSub:
    """One ``/chats/watch`` subscriber (events are pushed to its queue)."""

    def __init__(self, user: User) -> None:
        self.user = user
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()


class Core:
    """State and behaviour of the emulated deployment."""

    def __init__(self, cfg: Config, users: Sequence[User], organization_id: str) -> None:
        self.cfg = cfg
        self.users = list(users)
        self.users_by_token = {u.token: u for u in users}
        self.organization_id = organization_id
        self.ids = Ids()
        self.chats: dict[str, ChatRec] = {}
        self.files: dict[str, FileRec] = {}
        self.faults = FaultState()
        self.default_script: Script | None = None
        self.event_log: list[dict[str, Any]] = []
        self.watchers: set[WatchSub] = set()
        self.running_turns = 0
        self._capacity: asyncio.Semaphore | None = (
            asyncio.Semaphore(cfg.max_concurrent_root_chats)
            if cfg.max_concurrent_root_chats
            else None
        )
        self._closed = False

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        """Current time from the configured clock."""
        return self.cfg.clock()

    def log(self, kind: str, chat_id: str | None = None, **details: Any) -> None:
        """Append to the introspection event log."""
        self.event_log.append(
            {
                "time": time.time(),
                "mono": time.monotonic(),
                "kind": kind,
                "chat_id": chat_id,
                "details": details,
            }
        )
        if len(self.event_log) > self.cfg.max_event_log:
            del self.event_log[: len(self.event_log) // 10]

    def view(self, chat: ChatRec) -> ExecView:
        """The state machine's view of a chat."""
        return ExecView(chat.status, len(chat.queue), chat.archived, self.cfg.queue_cap)

    def notify(self, chat: ChatRec) -> None:
        """Wake every stream subscriber of the chat (a pubsub hint)."""
        for sub in chat.subscribers:
            sub.wake()

    def _watch(self, chat: ChatRec, kind: str, **extra: Any) -> None:
        if not self.watchers:
            return
        ev = {"kind": kind, "chat": chat.render(), **extra}
        for w in self.watchers:
            if w.user.id == chat.owner.id or w.user.id in chat.shared_with:
                w.queue.put_nowait(ev)

    def _set_status(self, chat: ChatRec, status: str) -> None:
        if chat.status == status:
            return
        old, chat.status = chat.status, status
        chat.updated_at = self.now()
        self.log("status", chat.id, old=old, new=status)
        self._watch(chat, "status_change")

    def _user_wire(
        self, chat: ChatRec, content: list[dict[str, Any]], user: User
    ) -> dict[str, Any]:
        return {
            "chat_id": chat.id,
            "created_by": user.id,
            "model_config_id": chat.model_config_id,
            "created_at": rfc3339(self.now()),
            "role": "user",
            "content": content,
        }

    def _commit_rows(self, chat: ChatRec, rows: list[tuple[dict[str, Any], str]]) -> list[MsgRec]:
        """Insert rows in one transaction: ids from the global sequence, one history bump."""
        if not rows:
            return []
        chat.history_version += 1
        chat.generation_attempt = 0
        chat.retry = None
        out = []
        for wire, vis in rows:
            wire = {"id": self.ids.message(), **wire}
            rec = MsgRec(wire, vis, chat.history_version)
            chat.messages.append(rec)
            out.append(rec)
            self.log("message", chat.id, id=rec.id, role=wire["role"], visibility=vis)
        chat.updated_at = self.now()
        chat.has_unread = True
        return out

    def _tool_result_row(
        self,
        chat: ChatRec,
        call_id: str,
        name: str,
        result: Any,
        is_error: bool,
        created_by: str | None,
    ) -> dict[str, Any]:
        part: dict[str, Any] = {
            "type": "tool-result",
            "tool_call_id": call_id,
            "tool_name": name,
            "result": result,
        }
        if is_error:
            part["is_error"] = True
        wire: dict[str, Any] = {
            "chat_id": chat.id,
            "created_at": rfc3339(self.now()),
            "role": "tool",
            "content": [part],
        }
        if created_by:
            wire["created_by"] = created_by
        return wire

    def _open_tool_calls(self, chat: ChatRec) -> list[tuple[str, str]]:
        calls: dict[str, str] = {}
        done: set[str] = set()
        for m in chat.live_messages():
            for p in m.wire.get("content") or []:
                if p.get("type") == "tool-call" and not p.get("provider_executed"):
                    calls[p["tool_call_id"]] = p["tool_name"]
                elif p.get("type") == "tool-result":
                    done.add(p["tool_call_id"])
        return [(cid, n) for cid, n in calls.items() if cid not in done]

    # -------------------------------------------------------------- transitions
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
    ) -> dict[str, Any]:
        """Apply a transition's effects in order, then its status; returns what was inserted."""
        rows: list[tuple[dict[str, Any], str]] = []
        info: dict[str, Any] = {"message": None, "queued_message": None, "promoted": []}
        user_row_idx: int | None = None
        promoted_idx: list[int] = []
        queue_changed = False
        start = False
        for eff in outcome.effects:
            k = eff.kind
            if k is EffectKind.CLOSE_OPEN_TOOL_CALLS:
                for cid, name in self._open_tool_calls(chat):
                    rows.append(
                        (self._tool_result_row(chat, cid, name, eff.reason, True, None), "both")
                    )
                chat.pending_calls = []
            elif k is EffectKind.CANCEL_PENDING_DYNAMIC:
                for c in chat.pending_calls:
                    rows.append(
                        (
                            self._tool_result_row(
                                chat, c["tool_call_id"], c["tool_name"], eff.reason, True, None
                            ),
                            "both",
                        )
                    )
                chat.pending_calls = []
            elif k is EffectKind.INSERT_MESSAGE:
                assert content is not None and user is not None
                user_row_idx = len(rows)
                rows.append((self._user_wire(chat, content, user), "both"))
            elif k is EffectKind.ENQUEUE:
                assert content is not None
                q = {
                    "id": self.ids.queued(),
                    "chat_id": chat.id,
                    "model_config_id": chat.model_config_id,
                    "content": content,
                    "created_at": rfc3339(self.now()),
                    "_created_by": user.id if user else chat.owner.id,
                }
                chat.queue.append(q)
                info["queued_message"] = q
                queue_changed = True
            elif k is EffectKind.PROMOTE_HEAD:
                head = chat.queue.pop(0)
                promoted_idx.append(len(rows))
                creator = next((u for u in self.users if u.id == head["_created_by"]), chat.owner)
                wire = self._user_wire(chat, head["content"], creator)
                if self.cfg.stamp_queued_message_id:
                    wire["queued_message_id"] = head["id"]
                rows.append((wire, "both"))
                queue_changed = True
            elif k is EffectKind.MOVE_TO_HEAD:
                item = next(q for q in chat.queue if q["id"] == queued_id)
                chat.queue.remove(item)
                chat.queue.insert(0, item)
                queue_changed = True
            elif k is EffectKind.DELETE_QUEUED:
                chat.queue = [q for q in chat.queue if q["id"] != queued_id]
                queue_changed = True
            elif k is EffectKind.CLEAR_ERROR:
                chat.last_error = None
            elif k is EffectKind.SET_ERROR:
                chat.last_error = error or {
                    "message": "The chat request failed unexpectedly.",
                    "kind": "generic",
                    "retryable": False,
                }
            elif k is EffectKind.START_TURN:
                start = True
            elif k is EffectKind.SIGNAL_INTERRUPT:
                chat.interrupt_flag = True
                if chat.wake is not None:
                    chat.wake.set()
            elif k is EffectKind.ARM_DEADLINE:
                self._arm_deadline(chat)
            elif k is EffectKind.DISARM_DEADLINE:
                self._disarm_deadline(chat)
            elif k is EffectKind.INSERT_TOOL_RESULTS:
                names = {c["tool_call_id"]: c["tool_name"] for c in chat.pending_calls}
                for r in results or []:
                    rows.append(
                        (
                            self._tool_result_row(
                                chat,
                                r["tool_call_id"],
                                names.get(r["tool_call_id"], ""),
                                r["output"],
                                bool(r.get("is_error", False)),
                                user.id if user else None,
                            ),
                            "both",
                        )
                    )
                chat.pending_calls = []
            elif k is EffectKind.SET_ARCHIVED:
                chat.archived = bool(eff.value)
                chat.updated_at = self.now()
        recs = self._commit_rows(chat, rows)
        if user_row_idx is not None:
            info["message"] = recs[user_row_idx].wire
        info["promoted"] = [recs[i].wire for i in promoted_idx]
        info["inserted"] = [r.wire for r in recs]
        if queue_changed:
            chat.queue_version += 1
            chat.updated_at = self.now()
            self.log("queue", chat.id, size=len(chat.queue))
        self._set_status(chat, outcome.status)
        if outcome.status != sm.REQUIRES_ACTION:
            chat.requires_action_deadline = None
        if start:
            self._ensure_worker(chat)
        self.notify(chat)
        return info

    def _arm_deadline(self, chat: ChatRec) -> None:
        self._disarm_deadline(chat)
        t = self.cfg.requires_action_timeout
        chat.requires_action_deadline = self.now() + t
        loop = asyncio.get_running_loop()
        chat.deadline_timer = loop.call_later(t, self.expire_requires_action, chat.id)

    def _disarm_deadline(self, chat: ChatRec) -> None:
        if chat.deadline_timer is not None:
            chat.deadline_timer.cancel()
            chat.deadline_timer = None

    def expire_requires_action(self, chat_id: str) -> bool:
        """The requires_action deadline passed (or a test forces it): A* → R*."""
        chat = self.chats.get(chat_id)
        if chat is None or chat.status != sm.REQUIRES_ACTION:
            return False
        chat.deadline_timer = None
        self.log("requires_action_timeout", chat.id)
        self.apply(chat, sm.cancel_requires_action(self.view(chat)))
        return True

    # -------------------------------------------------------------- operations
    def create_chat(
        self, user: User, body: dict[str, Any], content: list[dict[str, Any]]
    ) -> ChatRec:
        """POST /chats after validation: insert system rows + user message, start the turn."""
        now = self.now()
        first_text = next((p["text"] for p in content if p.get("type") == "text"), "")
        title = (first_text.splitlines()[0] if first_text else "New Chat")[:80] or "New Chat"
        chat = ChatRec(
            id=new_uuid(),
            organization_id=self.organization_id,
            owner=user,
            title=str(body.get("title") or title),
            created_at=now,
            updated_at=now,
            client_type=body.get("client_type") or "api",
            labels=dict(body.get("labels") or {}),
            workspace_id=body.get("workspace_id"),
            model_config_id=body.get("model_config_id") or DEFAULT_MODEL_CONFIG_ID,
            mcp_server_ids=list(dict.fromkeys(body.get("mcp_server_ids") or [])),
            plan_mode=body.get("plan_mode") or "",
            reasoning_effort=body.get("reasoning_effort"),
            dynamic_tools={t["name"]: t for t in body.get("unsafe_dynamic_tools") or []},
        )
        chat.wake = asyncio.Event()
        self.chats[chat.id] = chat
        system_rows: list[tuple[dict[str, Any], str]] = [
            (
                {
                    "chat_id": chat.id,
                    "created_at": rfc3339(now),
                    "role": "system",
                    "content": [{"type": "text", "text": "You are Coder Agent (emulated)."}],
                },
                "model",
            ),
        ]
        if body.get("system_prompt"):
            system_rows.append(
                (
                    {
                        "chat_id": chat.id,
                        "created_at": rfc3339(now),
                        "role": "system",
                        "content": [{"type": "text", "text": body["system_prompt"]}],
                    },
                    "model",
                )
            )
        outcome = sm.create_chat(empty_content=not content)
        # System rows and the user message are one transaction (one history bump).
        if content:
            rows = [*system_rows, (self._user_wire(chat, content, user), "both")]
            self._commit_rows(chat, rows)
            chat.status = outcome.status
            self.log("chat_created", chat.id, owner=user.username)
            self.log("status", chat.id, old=None, new=chat.status)
            self._watch(chat, "created")
            self._ensure_worker(chat)
        else:
            self._commit_rows(chat, system_rows)
            chat.status = outcome.status
            self.log("chat_created", chat.id, owner=user.username)
            self._watch(chat, "created")
        return chat

    def send_message(
        self, chat: ChatRec, user: User, content: list[dict[str, Any]], busy: str
    ) -> dict[str, Any]:
        """POST /messages transition; returns the CreateChatMessageResponse body."""
        outcome = sm.send_message(self.view(chat), busy)
        info = self.apply(chat, outcome, content=content, user=user)
        resp: dict[str, Any] = {"queued": outcome.queued}
        if outcome.queued:
            resp["queued_message"] = _public_queued(info["queued_message"])
            if info["promoted"]:
                resp["messages"] = info["inserted"]
        else:
            resp["message"] = info["message"]
            if len(info["inserted"]) > 1:
                resp["messages"] = info["inserted"]
        return resp

    def submit_tool_results(self, chat: ChatRec, user: User, results: list[dict[str, Any]]) -> None:
        """POST /tool-results: 409 unless requires_action, then validation, then A→R."""
        outcome = sm.complete_requires_action(self.view(chat))
        if not results:
            raise Refused(400, "At least one tool result is required.")
        sm.validate_tool_results([c["tool_call_id"] for c in chat.pending_calls], results)
        clean = [
            {
                **r,
                "output": json.loads(r["output"].text)
                if isinstance(r["output"], type(sm.raw_json("")))
                else r["output"],
            }
            for r in results
        ]
        self.apply(chat, outcome, user=user, results=clean)

    def interrupt(self, chat: ChatRec) -> None:
        """POST /interrupt."""
        self.apply(chat, sm.interrupt(self.view(chat)))

    def delete_queued(self, chat: ChatRec, qid: int) -> None:
        """DELETE /queue/{id}."""
        found = any(q["id"] == qid for q in chat.queue)
        self.apply(chat, sm.delete_queued(self.view(chat), found), queued_id=qid)

    def promote_queued(self, chat: ChatRec, qid: int) -> None:
        """POST /queue/{id}/promote."""
        found = any(q["id"] == qid for q in chat.queue)
        self.apply(chat, sm.promote_queued(self.view(chat), found), queued_id=qid)

    def set_archived(self, chat: ChatRec, archived: bool) -> None:
        """PATCH archived (cascades to children; none are created by the emulator)."""
        self.apply(chat, sm.set_archived(self.view(chat), archived))
        self.log("archived", chat.id, archived=archived)
        self._watch(chat, "deleted" if archived else "created")

    def edit_message(
        self, chat: ChatRec, msg_id: int, content: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """PATCH /messages/{id}: replace a user message, soft-delete everything after it,
        clear the queue and start a new turn from there."""
        target = next((m for m in chat.visible_messages() if m.id == msg_id), None)
        if target is None:
            raise Refused(404, "Chat message not found.")
        if target.wire["role"] != "user":
            raise Refused(400, "Only user messages can be edited.")
        outcome = sm.edit_message(self.view(chat))
        worker = chat.worker
        if worker is not None:
            # The running generation is abandoned (its output is discarded).
            chat.worker = None
            worker.cancel()
        chat.interrupt_flag = False
        chat.turn = None
        chat.pending_calls = []
        chat.retry = None
        if chat.queue:
            chat.queue = []
            chat.queue_version += 1
        chat.history_version += 1
        chat.generation_attempt = 0
        for m in chat.messages:
            if m.id > msg_id and not m.deleted:
                m.deleted = True
        target.wire = {**target.wire, "content": content}
        target.revision = chat.history_version
        chat.reset_versions.append(chat.history_version)
        chat.updated_at = self.now()
        self.log("message_edited", chat.id, id=msg_id)
        self.apply(chat, outcome)
        return {"message": target.wire}

    def set_title(self, chat: ChatRec, title: str) -> None:
        """PATCH title."""
        if title != chat.title:
            chat.title = title
            chat.updated_at = self.now()
            self._watch(chat, "title_change")

    # ------------------------------------------------------------------ worker
    def _ensure_worker(self, chat: ChatRec) -> None:
        if chat.worker is None and not self._closed:
            chat.worker = asyncio.get_running_loop().create_task(self._worker(chat))

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
        if self.default_script is not None:
            return self.default_script
        reply = f"Echo: {text}" if text else "Echo: (no text)"
        return Script((Step((Text(reply),)),))

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
                        self.notify(chat)
                    await self._pause(chat, 0.05)
                if chat.queued_for_capacity:
                    chat.queued_for_capacity = False
                    self.notify(chat)
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
                    self.apply(chat, sm.finish_turn(self.view(chat)))
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
            if acquired and self._capacity is not None:
                self._capacity.release()

    def _enter_requires_action(self, chat: ChatRec) -> bool:
        """Second transaction after a tool-call commit; False if an interrupt won the race."""
        assert chat.turn is not None
        pending, chat.turn.pending_enter = chat.turn.pending_enter, []
        if chat.status == sm.RUNNING and not chat.interrupt_flag:
            chat.pending_calls = pending
            self.apply(chat, sm.enter_requires_action(self.view(chat)))
            self._watch(chat, "action_required", tool_calls=[dict(c) for c in pending])
            return True
        rows = [
            (
                self._tool_result_row(
                    chat, c["tool_call_id"], c["tool_name"], sm.REASON_INTERRUPT, True, None
                ),
                "both",
            )
            for c in pending
        ]
        self._commit_rows(chat, rows)
        self.notify(chat)
        return False

    def _turn_start(self, chat: ChatRec) -> None:
        self.running_turns += 1
        self.log("turn_start", chat.id, running=self.running_turns)

    def _turn_end(self, chat: ChatRec, outcome: str) -> None:
        self.running_turns -= 1
        self.log("turn_end", chat.id, outcome=outcome, running=self.running_turns)

    def _next_step(self, chat: ChatRec) -> Step | None:
        turn = chat.turn
        assert turn is not None
        step = turn.next_step()
        if step is not None:
            turn.step_idx += 1
            return step
        if turn.follow_up_pending:
            turn.follow_up_pending = False
            return Step((Text(self._results_summary(chat)),))
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
        if self.cfg.interrupt_wind_down > 0:
            await asyncio.sleep(self.cfg.interrupt_wind_down)

    def _finish_interruption(self, chat: ChatRec) -> None:
        chat.interrupt_flag = False
        chat.turn = None
        self.apply(chat, sm.finish_interruption(self.view(chat)))

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
        try:
            await asyncio.wait_for(chat.wake.wait(), seconds)
        except TimeoutError:
            pass
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
        self.notify(chat)

    def _begin_attempt(self, chat: ChatRec) -> None:
        chat.generation_attempt += 1
        chat.retry = None
        chat.buffers[chat.episode] = []
        # Keep only recent episodes; older ones are garbage-collected (spec: ≥15 s later).
        for ep in list(chat.buffers)[:-3]:
            del chat.buffers[ep]
            chat.retired.discard(ep)
        self.notify(chat)

    async def _run_step(self, chat: ChatRec, step: Step) -> str:
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
                    "retrying_at": rfc3339(self.now() + delay),
                }
                if failure.provider:
                    chat.retry["provider"] = failure.provider
                if failure.status_code is not None:
                    chat.retry["status_code"] = failure.status_code
                chat.retry_version += 1
                self.log("retry", chat.id, attempt=attempt_no)
                self.notify(chat)
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
                self.apply(chat, sm.finish_error(self.view(chat)), error=err)
                return "error"
            delay = step.commit_delay or self.cfg.commit_delay
            if delay:
                await asyncio.sleep(delay)
            return self._commit_step(chat, step, partial)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _stream(self, chat: ChatRec, step: Step, partial: Partial, limit: int | None) -> bool:
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
                n = p.deltas or self.cfg.delta_count
                delay = self.cfg.delta_delay if p.delay is None else p.delay
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
                call_id = p.id or self.ids.tool_call()
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
                    if await self._pause(chat, self.cfg.delta_delay):
                        return True
                full = {**base, "args": p.args, "created_at": rfc3339(self.now())}
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
                    if await self._pause(chat, self.cfg.delta_delay):
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

    def _usage(self, chat: ChatRec, partial: Partial, step: Step) -> dict[str, int]:
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

    def _commit_step(self, chat: ChatRec, step: Step, partial: Partial) -> str:
        wire = {
            "chat_id": chat.id,
            "model_config_id": chat.model_config_id,
            "created_at": rfc3339(self.now()),
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
            if isinstance(spec, ClientToolCall):
                if spec.name in chat.dynamic_tools:
                    pending.append(
                        {"tool_call_id": key, "tool_name": spec.name, "args": json.dumps(spec.args)}
                    )
                else:
                    # Not a declared dynamic tool: runs as an (unknown) built-in and fails.
                    rows.append(
                        (
                            self._tool_result_row(
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
        self._commit_rows(chat, rows)
        self.notify(chat)
        if (
            chat.turn is not None
            and step is chat.turn.script.steps[-1]
            and (
                pending
                or any(isinstance(c["spec"], ClientToolCall) for c in partial.calls.values())
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
            "created_at": rfc3339(self.now()),
            "role": "assistant",
            "content": content,
            "usage": self._usage(chat, partial, Step()),
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
            elif isinstance(spec, ClientToolCall):
                rows.append(
                    (
                        self._tool_result_row(
                            chat, key, spec.name, sm.REASON_INTERRUPT, True, None
                        ),
                        "both",
                    )
                )
        self._commit_rows(chat, rows)
        self.notify(chat)

    # ---------------------------------------------------------------- shutdown
    async def aclose(self) -> None:
        """Cancel workers and timers."""
        self._closed = True
        tasks = [c.worker for c in self.chats.values() if c.worker is not None]
        for c in self.chats.values():
            self._disarm_deadline(c)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------- introspection
    def chat_info(self, chat: ChatRec) -> dict[str, Any]:
        """Introspection view of a chat (wire Chat + execution details)."""
        return {
            **chat.render(),
            "queue": [_public_queued(q) for q in chat.queue],
            "execution_state": sm.classify(self.view(chat)),
            "history_version": chat.history_version,
            "generation_attempt": chat.generation_attempt,
            "pending_tool_calls": [dict(c) for c in chat.pending_calls],
            "requires_action_deadline": chat.requires_action_deadline,
            "subscribers": len(chat.subscribers),
            "worker_active": chat.worker is not None,
            "dynamic_tools": sorted(chat.dynamic_tools),
        }

    def messages_info(self, chat: ChatRec, include_system: bool = True) -> list[dict[str, Any]]:
        """All stored rows, oldest first, with visibility and revision."""
        return [
            {**m.wire, "visibility": m.visibility, "revision": m.revision, "deleted": m.deleted}
            for m in chat.messages
            if include_system or m.visibility == "both"
        ]


def _public_queued(q: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in q.items() if not k.startswith("_")}


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


__all__ = ["Config", "Core", "Effect", "FileRec", "WatchSub"]

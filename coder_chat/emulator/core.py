"""The emulated chatd daemon's state and transactions: chats, transitions, watch fan-out.

Runs on one asyncio loop; every method that mutates state is synchronous (one "database
transaction"). Transitions are decided by the pure ``statemachine`` module; this module
applies their effects, records them in the event log and notifies subscribers. The scripted
model that drives running chats lives in ``worker.py``; read-only views in ``views.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from . import statemachine as sm
from .config import DEFAULT_MODEL_CONFIG_ID, Config
from .faults import FaultState
from .script import Script
from .statemachine import Effect, EffectKind, ExecView, Outcome, Refused
from .store import ChatRec, FileRec, Ids, MsgRec, User, new_uuid, rfc3339
from .views import public_queued
from .worker import Worker


class WatchSub:
    """One ``/chats/watch`` subscriber (events are pushed to its queue)."""

    def __init__(self, user: User) -> None:
        self.user = user
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()


class Core:
    """State and transactions of the emulated deployment."""

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
        self.worker = Worker(self)

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

    def watch(self, chat: ChatRec, kind: str, **extra: Any) -> None:
        """Fan a ``ChatWatchEvent`` out to the watchers allowed to read the chat."""
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
        self.watch(chat, "status_change")

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

    def commit_rows(self, chat: ChatRec, rows: list[tuple[dict[str, Any], str]]) -> list[MsgRec]:
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

    def tool_result_row(
        self,
        chat: ChatRec,
        call_id: str,
        name: str,
        result: Any,
        is_error: bool,
        created_by: str | None,
    ) -> dict[str, Any]:
        """A role ``tool`` row carrying one ``tool-result`` part."""
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
                        (self.tool_result_row(chat, cid, name, eff.reason, True, None), "both")
                    )
                chat.pending_calls = []
            elif k is EffectKind.CANCEL_PENDING_DYNAMIC:
                for c in chat.pending_calls:
                    rows.append(
                        (
                            self.tool_result_row(
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
                qid = self.ids.queued()
                q: dict[str, Any] = {
                    "id": qid,
                    "chat_id": chat.id,
                    "model_config_id": chat.model_config_id,
                    "content": content,
                    "created_at": rfc3339(self.now()),
                }
                chat.queue.append(q)
                # Who queued it is server-side only (it becomes the promoted row's
                # created_by); the wire ChatQueuedMessage has no such field.
                chat.queue_authors[qid] = user.id if user else chat.owner.id
                info["queued_message"] = q
                queue_changed = True
            elif k is EffectKind.PROMOTE_HEAD:
                head = chat.queue.pop(0)
                promoted_idx.append(len(rows))
                author = chat.queue_authors.pop(head["id"], chat.owner.id)
                creator = next((u for u in self.users if u.id == author), chat.owner)
                wire = self._user_wire(chat, head["content"], creator)
                if self.cfg.stamps_queued_message_id:
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
                if queued_id is not None:
                    chat.queue_authors.pop(queued_id, None)
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
                            self.tool_result_row(
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
        recs = self.commit_rows(chat, rows)
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
            self.worker.ensure(chat)
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

    def end_sleeps(self, chat_id: str | None = None) -> int:
        """End the scripted sleeps in progress now, as if their time had passed (the
        turn goes on; nothing is interrupted). How many were ended."""
        ended = 0
        for chat in self.chats.values():
            if (chat_id is None or chat.id == chat_id) and chat.sleeping and chat.wake:
                self.log("sleep_ended", chat.id)
                chat.wake.set()
                ended += 1
        return ended

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
            title=str((self.cfg.era.create_title and body.get("title")) or title),
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
            self.commit_rows(chat, rows)
            chat.status = outcome.status
            self.log("chat_created", chat.id, owner=user.username)
            self.log("status", chat.id, old=None, new=chat.status)
            self.watch(chat, "created")
            self.worker.ensure(chat)
        else:
            self.commit_rows(chat, system_rows)
            chat.status = outcome.status
            self.log("chat_created", chat.id, owner=user.username)
            self.watch(chat, "created")
        return chat

    def send_message(
        self, chat: ChatRec, user: User, content: list[dict[str, Any]], busy: str
    ) -> dict[str, Any]:
        """POST /messages transition; returns the CreateChatMessageResponse body."""
        outcome = sm.send_message(self.view(chat), busy, owned=self._owned(chat))
        info = self.apply(chat, outcome, content=content, user=user)
        resp: dict[str, Any] = {"queued": outcome.queued}
        if outcome.queued:
            resp["queued_message"] = public_queued(info["queued_message"])
            if info["promoted"]:
                resp["messages"] = info["inserted"]
        else:
            # Inserted directly, or (B3, unowned) queued and promoted at once.
            resp["message"] = info["message"] or info["promoted"][-1]
            if len(info["inserted"]) > 1:
                resp["messages"] = info["inserted"]
        return resp

    def _owned(self, chat: ChatRec) -> bool:
        """False only when the era finishes interrupts of a chat no worker holds."""
        return chat.owned or not self.cfg.era.unowned_interrupt_finishes

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
        self.apply(chat, sm.interrupt(self.view(chat), owned=self._owned(chat)))

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
        self.watch(chat, "deleted" if archived else "created")

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
            chat.owned = False
            worker.cancel()
        chat.interrupt_flag = False
        chat.turn = None
        chat.pending_calls = []
        chat.retry = None
        if chat.queue:
            chat.queue = []
            chat.queue_authors.clear()
            chat.queue_version += 1
        chat.history_version += 1
        chat.generation_attempt = 0
        deleted: list[int] = []
        for m in chat.messages:
            if m.id > msg_id and not m.deleted:
                m.deleted = True
                if m.visibility == "both":
                    deleted.append(m.id)
        target.wire = {**target.wire, "content": content}
        target.revision = chat.history_version
        chat.reset_versions.append(chat.history_version)
        chat.updated_at = self.now()
        self.log("message_edited", chat.id, id=msg_id)
        self.apply(chat, outcome)
        out: dict[str, Any] = {"message": target.wire}
        if deleted:
            out["deleted_message_ids"] = deleted
        return out

    def set_title(self, chat: ChatRec, title: str) -> None:
        """PATCH title."""
        if title != chat.title:
            chat.title = title
            chat.updated_at = self.now()
            self.watch(chat, "title_change")

    # ------------------------------------------------------------------ worker

    # ---------------------------------------------------------------- shutdown
    async def aclose(self) -> None:
        """Cancel workers and timers."""
        for c in self.chats.values():
            self._disarm_deadline(c)
        await self.worker.aclose()


__all__ = ["DEFAULT_MODEL_CONFIG_ID", "Config", "Core", "Effect", "FileRec", "WatchSub"]

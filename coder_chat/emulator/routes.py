"""The chatd REST routes: dispatch, auth, validation order, handlers (thin shell over ``core``).

WebSocket upgrades are answered here and handed to ``sessions.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from . import aibridge, files
from . import statemachine as sm
from .config import DEFAULT_MODEL_CONFIG_ID
from .core import Core
from .eras import EXPERIMENTAL_PREFIX, V2_PREFIX
from .faults import Hold, status_message
from .httpserver import (
    DROP,
    DropResponse,
    Request,
    Response,
    Upgrade,
    error_response,
    json_response,
)
from .listing import list_chats
from .sessions import StreamSession, WatchSession
from .statemachine import Refused
from .store import ChatRec, User
from .stream import StreamCursor
from .validation import (
    NOT_FOUND,
    REASONING_EFFORTS,
    is_uuid,
    parse_content,
    parse_uuid,
    validate_dynamic_tools,
    validate_labels,
)
from .views import public_queued

PREFIXES = (EXPERIMENTAL_PREFIX, V2_PREFIX)  # every build's; an era serves a subset
JSON_BODY_CAP = 256 * 1024
# Collection words mounted before the {chat} wildcard (coderd/chat_routes.go): reserved
# ones answer 404 on the server; the others are real routes the emulator does not serve.
RESERVED_SEGMENTS = frozenset({"model-configs", "models", "providers", "user-provider-configs"})
NOT_EMULATED_SEGMENTS = frozenset({"by-workspace", "config"})
SIGNED_OUT = "You are signed out or your session has expired. Please sign in again to continue."

Result = Response | DropResponse | Upgrade


def _refused(e: Refused) -> Response:
    return error_response(e.status, e.message, e.detail, getattr(e, "validations", None))


class Api:
    """Routes requests for the chat API onto the core."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.sessions: set[StreamSession] = set()
        self.watch_sessions: set[WatchSession] = set()

    # ------------------------------------------------------------------ dispatch
    async def handle(self, req: Request) -> Result:
        """Entry point for every non-control request."""
        core = self.core
        fault = None
        if core.faults.route_removed(req.method, req.path):
            # Checked first, whatever the token: the route itself is what is missing.
            core.log("fault", None, fault="remove_route", method=req.method, path=req.path)
            return error_response(404, "Route not found.")
        if req.is_upgrade:
            status = core.faults.take_upgrade_refusal(_chat_id_of(req.path), req.path)
            if status is not None:
                core.log("fault", None, fault="refuse_upgrade", status=status, path=req.path)
                return error_response(status, status_message(status))
        else:
            for hold in core.faults.releases(req.method, req.path):
                await hold.committed.wait()  # a held request commits before this one is served
            fault = core.faults.take_rest(req.method, req.path)
            if fault is not None:
                core.log("fault", None, fault=fault.action, method=req.method, path=req.path)
                if fault.action == "fail":
                    return error_response(fault.status, fault.error_message())
                if fault.action == "delay_commit":
                    await asyncio.sleep(fault.seconds)
                elif fault.action == "drop_response":
                    await self._dispatch(req)
                    return DROP
        if fault is not None and fault.action == "hold_commit":
            resp = await self._held(req, core.faults.hold(fault, req.path))
        else:
            resp = await self._dispatch(req)
        if core.cfg.log_requests:
            status = resp.status if isinstance(resp, Response) else 101
            core.log(
                "request", _chat_id_of(req.path), method=req.method, path=req.path, status=status
            )
        return resp

    async def _held(self, req: Request, hold: Hold) -> Result:
        """Run a request a ``hold_commit`` fault held, once released (or timed out)."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hold.release.wait(), hold.max_seconds)
            self.core.log("fault", None, fault="hold_commit_released", path=req.path)
            return await self._dispatch(req)
        finally:
            hold.committed.set()

    async def _dispatch(self, req: Request) -> Result:
        try:
            return await self._route(req)
        except Refused as e:
            return _refused(e)

    async def _route(self, req: Request) -> Result:
        path = req.path.rstrip("/") if req.path != "/" else req.path
        if path == "/api/v2/buildinfo":
            return json_response(
                200,
                {
                    "version": "v2.99.0-emulator",
                    "external_url": "",
                    "dashboard_url": "",
                    "agent_api_version": "1.0",
                },
            )
        if aibridge.handles(path):
            # The AI Gateway authenticates with provider-style keys, not the
            # Coder-Session-Token header.
            return aibridge.handle(self.core, req, path)
        user = self._auth(req)
        if path.startswith("/api/v2/organizations/") and path.endswith("/chats/models"):
            return self._models(req, path)
        if path == "/api/v2/users/me":
            return json_response(
                200,
                {
                    "id": user.id,
                    "username": user.username,
                    "organization_ids": [self.core.organization_id],
                },
            )
        for prefix in self.core.cfg.era.prefixes:  # B3: /api/v2 only
            if path == prefix or path.startswith(prefix + "/"):
                segs = [s for s in path[len(prefix) :].split("/") if s]
                return await self._chats(req, user, segs, prefix)
        return error_response(404, "Route not found.")

    def _auth(self, req: Request) -> User:
        token = req.header("coder-session-token")
        if not token:
            raise Refused(
                401,
                SIGNED_OUT,
                'Cookie "coder_session_token" or query parameter must be provided.',
            )
        user = self.core.users_by_token.get(token)
        if user is None:
            raise Refused(401, SIGNED_OUT, "API key is invalid.")
        return user

    async def _chats(self, req: Request, user: User, segs: list[str], prefix: str) -> Result:
        m = req.method
        if not segs:
            if m == "POST":
                return self._create(req, user)
            if m == "GET":
                return list_chats(self.core, req, user)
            return _method_not_allowed()
        head = segs[0]
        if head == "watch" and len(segs) == 1:
            return self._watch(req, user)
        if head == "files":
            if len(segs) == 1 and m == "POST":
                return files.upload(self.core, req, user)
            if len(segs) == 2 and m == "GET":
                return files.download(self.core, user, segs[1])
            return error_response(404, "Route not found.")
        if self._is_route_word(head, prefix):
            # The server mounts these words before its {chat} wildcard, so they are
            # routes (reserved → 404, or real routes the emulator does not serve),
            # never a malformed chat UUID (400).
            return error_response(404, "Route not found.")
        chat = self._chat(head, user)
        rest = segs[1:]
        if not rest:
            if m == "GET":
                return json_response(200, chat.render(children=[], single_read=True))
            if m == "PATCH":
                return self._patch(req, user, chat)
            return _method_not_allowed()
        what = rest[0]
        if what == "messages" and len(rest) == 1:
            if m == "GET":
                return self._get_messages(req, chat)
            if m == "POST":
                return self._post_message(req, user, chat)
        if what == "messages" and len(rest) == 2 and m == "PATCH":
            self._require_owner(user, chat, "edit messages")
            try:
                msg_id = int(rest[1])
            except ValueError:
                raise Refused(400, "Invalid chat message ID.") from None
            body = self._body(req)
            if not isinstance(body, dict):
                raise Refused(400, "Request body must be valid JSON.")
            content = parse_content(body.get("content"), self._file_lookup(user))
            return json_response(200, self.core.edit_message(chat, msg_id, content))
        if what == "tool-results" and len(rest) == 1 and m == "POST":
            return self._tool_results(req, user, chat)
        if what == "interrupt" and len(rest) == 1 and m == "POST":
            self._require_update(user, chat)
            self.core.interrupt(chat)
            return json_response(200, self._render(chat))
        if what == "queue" and len(rest) >= 2:
            qid = _queued_id(rest[1])
            if len(rest) == 2 and m == "DELETE":
                self._require_update(user, chat)
                self.core.delete_queued(chat, qid)
                return Response(204)
            if len(rest) == 3 and rest[2] == "promote" and m == "POST":
                self._require_owner(user, chat, "promote queued messages")
                self.core.promote_queued(chat, qid)
                return json_response(202, {"message": "Queued message promotion accepted."})
        if what == "stream" and len(rest) == 1 and m == "GET":
            return self._stream(req, user, chat)
        return error_response(404, "Route not found.")

    # ------------------------------------------------------------------ helpers
    def _is_route_word(self, word: str, prefix: str) -> bool:
        if word == "models" and prefix == V2_PREFIX:
            # B1 reserves /models on the experimental mount only: on v2 it is a chat id.
            return self.core.cfg.era.v2_reserves_models
        return word in RESERVED_SEGMENTS or word in NOT_EMULATED_SEGMENTS

    def _chat(self, raw: str, user: User) -> ChatRec:
        cid = parse_uuid(raw)
        chat = self.core.chats.get(cid)
        if chat is None or not (chat.owner.id == user.id or user.id in chat.shared_with):
            raise Refused(404, NOT_FOUND)
        return chat

    @staticmethod
    def _require_update(user: User, chat: ChatRec) -> None:
        # RBAC update denied reads as 404 (a shared reader cannot mutate).
        if chat.owner.id != user.id:
            raise Refused(404, NOT_FOUND)

    @staticmethod
    def _require_owner(user: User, chat: ChatRec, what: str) -> None:
        if chat.owner.id != user.id:
            raise Refused(403, f"Only the chat owner may {what}.")

    def _render(self, chat: ChatRec) -> dict[str, Any]:
        return chat.render(children=[])

    def _body(self, req: Request) -> Any:
        if req.too_large or len(req.body) > JSON_BODY_CAP:
            raise Refused(413, "Request body is too large.")
        try:
            return req.json()
        except ValueError:
            raise Refused(400, "Request body must be valid JSON.") from None

    def _file_lookup(self, user: User) -> Callable[[str], dict[str, Any] | None]:
        return lambda fid: files.file_part(self.core, user, fid)

    # ------------------------------------------------------------------- routes
    def _create(self, req: Request, user: User) -> Response:
        body = self._body(req)
        if not isinstance(body, dict):
            raise Refused(400, "Request body must be valid JSON.")
        org = body.get("organization_id")
        if not org:
            raise Refused(400, "organization_id is required.")
        if not is_uuid(org) or str(org) != self.core.organization_id:
            raise Refused(403, "You are not a member of the specified organization.")
        content = parse_content(
            body.get("content"),
            self._file_lookup(user),
            allow_empty=self.core.cfg.era.empty_content_create,  # B3: → waiting, "New Chat"
        )
        ws = body.get("workspace_id")
        if ws is not None and not is_uuid(ws):
            raise Refused(400, "Workspace not found or you do not have access to this resource")
        mc = body.get("model_config_id")
        if mc and mc != DEFAULT_MODEL_CONFIG_ID:
            raise Refused(400, f"Invalid model_config_id: {mc}")
        if body.get("plan_mode") not in (None, "", "plan"):
            raise Refused(400, "Invalid plan_mode value.")
        mcp = list(dict.fromkeys(body.get("mcp_server_ids") or []))
        if mcp:
            raise Refused(
                400, "One or more MCP server IDs are invalid or disabled.", ", ".join(map(str, mcp))
            )
        body["labels"] = validate_labels(body.get("labels"))
        validate_dynamic_tools(body.get("unsafe_dynamic_tools"))
        if body.get("client_type") not in (None, "", "ui", "api"):
            raise Refused(400, "Invalid client_type.")
        re_ = body.get("reasoning_effort")
        if re_ not in (None, "") and re_ not in REASONING_EFFORTS:
            raise Refused(400, "Invalid reasoning_effort value.")
        chat = self.core.create_chat(user, body, content)
        return json_response(201, self._render(chat))

    def _patch(self, req: Request, user: User, chat: ChatRec) -> Response:
        self._require_update(user, chat)
        body = self._body(req)
        if not isinstance(body, dict):
            raise Refused(400, "Request body must be valid JSON.")
        if self.core.cfg.era.patch_validates_first:
            _validate_patch(body, chat)  # B3: a 400 changes nothing
        # Applied in this order, not atomically: title → labels → archived → pin →
        # workspace → plan. B1/B2 validate as they go, so a later 400 leaves earlier
        # fields applied; in every build a 409 from the archive transition does.
        if "title" in body and body["title"] is not None:
            self.core.set_title(chat, str(body["title"]))
        if "labels" in body and body["labels"] is not None:
            chat.labels = validate_labels(body["labels"])
            chat.updated_at = self.core.now()
        if "archived" in body and body["archived"] is not None:
            if chat.parent_chat_id is not None:
                raise Refused(400, "Chat archive state can only be changed on the root chat.")
            self.core.set_archived(chat, bool(body["archived"]))
        if "pin_order" in body and body["pin_order"] is not None:
            try:
                chat.pin_order = max(0, int(body["pin_order"]))
            except (TypeError, ValueError):
                raise Refused(400, "Invalid pin_order value.") from None
        if "workspace_id" in body and body["workspace_id"] is not None:
            if not is_uuid(body["workspace_id"]):
                raise Refused(400, "Workspace not found or you do not have access to this resource")
            chat.workspace_id = str(body["workspace_id"])
        if "plan_mode" in body and body["plan_mode"] is not None:
            if body["plan_mode"] not in ("", "plan"):
                raise Refused(400, "Invalid plan_mode value.")
            chat.plan_mode = body["plan_mode"]
        return Response(204)

    def _get_messages(self, req: Request, chat: ChatRec) -> Response:
        before = _cursor(req.param("before_id"))
        after = _cursor(req.param("after_id"))
        raw_limit = req.param("limit")
        if raw_limit is None or raw_limit == "":
            limit = 50
        else:
            try:
                limit = int(raw_limit)
            except ValueError:
                raise Refused(400, "Query parameters have invalid values.") from None
            if limit < 0:
                raise Refused(400, "Query parameters have invalid values.")
            if limit == 0 or limit > 200:
                raise Refused(400, "Invalid limit parameter (1-200).")
        if before is not None and after is not None and after >= before:
            raise Refused(400, "after_id must be less than before_id.")
        rows = [m.wire for m in chat.visible_messages()]
        if after is not None:
            rows = [r for r in rows if r["id"] > after]
        if before is not None:
            rows = [r for r in rows if r["id"] < before]
        if after is not None and before is None:
            page = rows[: limit + 1]
        else:
            page = list(reversed(rows))[: limit + 1]
        has_more = len(page) > limit
        body: dict[str, Any] = {
            "messages": page[:limit],
            "queued_messages": [public_queued(q) for q in chat.queue]
            if before is None and after is None
            else [],
            "has_more": has_more,
        }
        if self.core.cfg.era.messages_history_version:
            # B3: turn_start_id on newest-first pages; history_version (the value to pass
            # as the /stream cursor) only on the cursor-less newest page.
            if not (after is not None and before is None):
                start = next(
                    (m.id for m in reversed(chat.visible_messages()) if m.wire["role"] == "user"),
                    None,
                )
                if start is not None:
                    body["turn_start_id"] = start
            if before is None and after is None:
                body["history_version"] = chat.history_version
        return json_response(200, body)

    def _post_message(self, req: Request, user: User, chat: ChatRec) -> Response:
        self._require_owner(user, chat, "send messages")
        if chat.archived:
            raise Refused(400, "Cannot send messages to an archived chat.")
        body = self._body(req)
        if not isinstance(body, dict):
            raise Refused(400, "Request body must be valid JSON.")
        content = parse_content(body.get("content"), self._file_lookup(user))
        busy = body.get("busy_behavior") or "queue"
        if busy not in ("queue", "interrupt"):
            raise Refused(400, "Invalid busy_behavior value.")
        mc = body.get("model_config_id")
        if mc and mc != DEFAULT_MODEL_CONFIG_ID:
            raise Refused(400, f"Invalid model_config_id: {mc}")
        if body.get("mcp_server_ids"):
            raise Refused(400, "One or more MCP server IDs are invalid or disabled.")
        re_ = body.get("reasoning_effort")
        if re_ not in (None, "") and re_ not in REASONING_EFFORTS:
            raise Refused(400, "Invalid reasoning_effort value.")
        if body.get("plan_mode") not in (None, "", "plan"):
            raise Refused(400, "Invalid plan_mode value.")
        resp = self.core.send_message(chat, user, content, busy)
        return json_response(200, resp)

    def _tool_results(self, req: Request, user: User, chat: ChatRec) -> Response:
        self._require_owner(user, chat, "submit tool results")
        if chat.archived:
            raise Refused(400, "Cannot submit tool results to an archived chat.")
        body = self._body(req)
        results = body.get("results") if isinstance(body, dict) else None
        if not results:
            raise Refused(400, "At least one tool result is required.")
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise Refused(400, "Request body must be valid JSON.")
        self.core.submit_tool_results(chat, user, results)
        return Response(204)

    def _models(self, req: Request, path: str) -> Response:
        org = path[len("/api/v2/organizations/") :].split("/")[0]
        if parse_uuid(org) != self.core.organization_id:
            raise Refused(404, NOT_FOUND)
        model = {
            "id": DEFAULT_MODEL_CONFIG_ID,
            "provider": "anthropic",
            "model": "claude-emulated",
            "display_name": "Emulated Model",
            "is_default": True,
            "context_limit": 200_000,
        }
        return json_response(
            200,
            {
                "models": [model],
                "providers": [{"provider": "anthropic", "available": True}],
                "unsupported_providers": [],
            },
        )

    # ------------------------------------------------------------- websockets
    def _stream(self, req: Request, user: User, chat: ChatRec) -> Result:
        era = self.core.cfg.era
        raw = req.param("after_id")
        after_id = 0
        if raw not in (None, ""):
            try:
                after_id = int(raw)
            except ValueError:
                raise Refused(400, "Invalid after_id parameter.") from None
        cursor = StreamCursor(
            chat.id, after_id=after_id, status_history_version=era.status_history_version
        )
        # The revision cursor differs per build: B1 has none (after_revision ignored),
        # B2 reads after_revision, B3 renamed it history_version (≤ the chat's, and a
        # non-zero value overrides after_id); each build ignores the other names.
        name = era.stream_cursor
        rev = req.param(name) if name else None
        if name and rev:
            try:
                r = int(rev)
            except ValueError:
                r = -1
            if r < 0 or (name == "history_version" and r > chat.history_version):
                raise Refused(400, f"Invalid {name} parameter.")
            if name == "history_version" and r > 0:
                cursor.after_id = 0
            cursor.last_history_version = r
            cursor.cursor_revision = r
        if not req.is_upgrade:
            return error_response(400, "Expected a WebSocket upgrade.")
        session = StreamSession(self, chat, user, cursor)
        return Upgrade(session.run)

    def _watch(self, req: Request, user: User) -> Result:
        if not req.is_upgrade:
            return error_response(400, "Expected a WebSocket upgrade.")
        session = WatchSession(self, user)
        return Upgrade(session.run)

    def drop_streams(self, chat_id: str | None, code: int | None) -> int:
        """Drop every open stream (of one chat) now."""
        n = 0
        for s in list(self.sessions):
            if chat_id is None or s.chat.id == chat_id:
                s.drop(code)
                n += 1
        return n


def _validate_patch(body: dict[str, Any], chat: ChatRec) -> None:
    """Every PATCH field checked before the first write (B3), with the same messages."""
    if body.get("labels") is not None:
        validate_labels(body["labels"])
    if body.get("archived") is not None:
        if chat.parent_chat_id is not None:
            raise Refused(400, "Chat archive state can only be changed on the root chat.")
        if bool(body["archived"]) == chat.archived:
            raise Refused(
                400, sm.MSG_ALREADY_ARCHIVED if chat.archived else sm.MSG_ALREADY_UNARCHIVED
            )
    if body.get("pin_order") is not None:
        try:
            int(body["pin_order"])
        except (TypeError, ValueError):
            raise Refused(400, "Invalid pin_order value.") from None
    if body.get("workspace_id") is not None and not is_uuid(body["workspace_id"]):
        raise Refused(400, "Workspace not found or you do not have access to this resource")
    if body.get("plan_mode") is not None and body["plan_mode"] not in ("", "plan"):
        raise Refused(400, "Invalid plan_mode value.")


def _cursor(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise Refused(400, "Query parameters have invalid values.") from None
    if v <= 0:
        raise Refused(400, "Query parameters have invalid values.")
    return v


def _queued_id(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise Refused(400, "Invalid queued message ID.") from None


def _chat_id_of(path: str) -> str | None:
    for prefix in PREFIXES:
        if path.startswith(prefix + "/"):
            seg = path[len(prefix) + 1 :].split("/")[0]
            if is_uuid(seg):
                return seg
    return None


def _method_not_allowed() -> Response:
    return error_response(405, "Method not allowed.")

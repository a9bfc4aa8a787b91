"""GET /chats: the search query (``q``), label filters, order and paging (spec §1.2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import statemachine as sm
from .httpserver import Request, Response, json_response
from .statemachine import Refused
from .validation import is_uuid, positive_int, split_query

if TYPE_CHECKING:
    from .core import Core
    from .store import User


def list_chats(core: Core, req: Request, user: User) -> Response:
    """The caller's root chats matching the query, pinned first, then newest first."""
    era = core.cfg.era
    archived: bool | None = False
    statuses: set[str] | None = None
    title_like: str | None = None
    has_unread: bool | None = None
    source = "created_by_me"
    pr_none_only = False
    for key, value in split_query(" ".join(req.query.get("q", []))):
        if key == "archived":
            if value not in ("true", "false", "any") or (value == "any" and not era.status_search):
                raise Refused(400, "Invalid chat search query.", f"archived: {value!r}")
            archived = None if value == "any" else value == "true"
        elif key == "status" and era.status_search:
            vals = {v for v in value.split(",") if v}
            if not vals or not vals <= set(sm.STATUSES):
                raise Refused(400, "Invalid chat search query.", f"status: {value!r}")
            statuses = (statuses or set()) | vals
        elif key == "has_unread":
            if value not in ("true", "false"):
                raise Refused(400, "Invalid chat search query.", f"has_unread: {value!r}")
            has_unread = value == "true"
        elif key == "title" or (key == "search" and era.search_key):
            title_like = value.lower()
        elif key == "source":
            if value not in ("created_by_me", "shared_with_me"):
                raise Refused(400, "Invalid chat search query.", f"source: {value!r}")
            source = value
        elif key == "pr_status":
            allowed = {"draft", "open", "merged", "closed"} | (
                {"none"} if era.status_search else set()
            )
            if not set(value.split(",")) <= allowed:
                raise Refused(400, "Invalid chat search query.", f"pr_status: {value!r}")
            pr_none_only = "none" not in value.split(",")
        elif key in ("pr", "repo", "pr_title", "diff_url"):
            pr_none_only = True  # emulated chats have no PRs: these match nothing
        else:
            raise Refused(400, "Invalid chat search query.", f"unknown key {key!r}")
    labels: dict[str, str] = {}
    for raw in req.query.get("label", []):
        k, sep, v = raw.partition(":")
        if not sep or not k or not v:
            raise Refused(
                400,
                f'Invalid label filter: "{raw}" (expected format key:value, both must be '
                "non-empty)",
            )
        labels[k] = v
    limit = positive_int(req.param("limit")) or 50
    offset = positive_int(req.param("offset")) or 0
    after = req.param("after_id")
    if after is not None and after != "" and not is_uuid(after):
        raise Refused(400, "Query parameters have invalid values.", "after_id must be a UUID")
    rows = []
    for c in core.chats.values():
        if c.parent_chat_id is not None:
            continue
        if source == "created_by_me" and c.owner.id != user.id:
            continue
        if source == "shared_with_me" and user.id not in c.shared_with:
            continue
        if archived is not None and c.archived != archived:
            continue
        if statuses is not None and c.status not in statuses:
            continue
        if has_unread is not None and c.has_unread != has_unread:
            continue
        if title_like is not None and title_like not in c.title.lower():
            continue
        if pr_none_only:
            continue
        if any(c.labels.get(k) != v for k, v in labels.items()):
            continue
        rows.append(c)
    rows.sort(key=lambda c: (c.pin_order == 0, c.pin_order, -c.updated_at, _neg_id(c.id)))
    if after:
        idx = next((i for i, c in enumerate(rows) if c.id == str(after)), None)
        rows = [] if idx is None else rows[idx + 1 :]
    rows = rows[offset : offset + limit]
    return json_response(200, [c.render(children=[]) for c in rows])


def _neg_id(cid: str) -> tuple[int, ...]:
    return tuple(-b for b in bytes.fromhex(cid.replace("-", "")))

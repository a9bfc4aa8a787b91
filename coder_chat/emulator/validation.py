"""Request validation mirroring the Coder handlers' messages and order (no I/O)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from .statemachine import Refused

LABEL_KEY = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._/-]*$")
REASONING_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
MAX_DYNAMIC_TOOLS = 250
MAX_LABELS = 50
# httpapi.ResourceNotFound: unknown and unreadable resources answer alike.
NOT_FOUND = "Resource not found or you do not have access to this resource"


def parse_uuid(raw: str) -> str:
    """Parse a path UUID: 400 ``Invalid UUID "<raw>".`` with the parse error as detail."""
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        # Go's uuid.Parse wording.
        detail = (
            "invalid UUID format"
            if len(raw) in (32, 36, 38, 45)
            else f"invalid UUID length: {len(raw)}"
        )
        raise Refused(400, f'Invalid UUID "{raw}".', detail) from None


def is_uuid(raw: Any) -> bool:
    """True when ``raw`` is a UUID string."""
    if not isinstance(raw, str):
        return False
    try:
        uuid.UUID(raw)
    except ValueError:
        return False
    return True


def validate_labels(labels: Any) -> dict[str, str]:
    """``ValidateChatLabels``: 400 ``Invalid labels.`` with one validation per violation."""
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise Refused(400, "Invalid labels.", "labels must be an object")
    problems: list[dict[str, str]] = []
    if len(labels) > MAX_LABELS:
        problems.append({"field": "labels", "detail": f"too many labels ({len(labels)} > 50)"})
    for k, v in labels.items():
        if not k:
            problems.append({"field": "labels", "detail": "label key must not be empty"})
        elif len(k.encode()) > 64:
            problems.append({"field": "labels", "detail": f"label key {k!r} exceeds 64 bytes"})
        elif not LABEL_KEY.match(k):
            problems.append(
                {"field": "labels", "detail": f"label key {k!r} contains invalid characters"}
            )
        if not isinstance(v, str) or not v:
            problems.append({"field": "labels", "detail": f"label {k!r} value must not be empty"})
        elif len(v.encode()) > 256:
            problems.append({"field": "labels", "detail": f"label {k!r} value exceeds 256 bytes"})
    if problems:
        err = Refused(400, "Invalid labels.")
        err.validations = problems  # type: ignore[attr-defined]
        raise err
    return dict(labels)


def parse_content(
    content: Any, file_lookup: Callable[[str], dict[str, Any] | None], *, allow_empty: bool = False
) -> list[dict[str, Any]]:
    """``createChatInputFromParts``: normalise input parts to stored message parts."""
    if content is None or (isinstance(content, list) and not content):
        if allow_empty:
            return []
        raise Refused(400, "Content is required.")
    if not isinstance(content, list):
        raise Refused(400, "Invalid input part.", "content must be an array")
    out: list[dict[str, Any]] = []
    for i, p in enumerate(content):
        t = p.get("type") if isinstance(p, dict) else None
        if t == "text":
            text = str(p.get("text") or "").strip()
            if not text:
                raise Refused(400, "Invalid input part.", f"content[{i}].text cannot be empty.")
            out.append({"type": "text", "text": text})
        elif t == "file":
            fid = p.get("file_id")
            f = file_lookup(fid) if is_uuid(fid) else None
            if f is None:
                raise Refused(400, "Invalid input part.", f"content[{i}].file_id is invalid.")
            out.append({"type": "file", **f})
        elif t == "file-reference":
            try:
                out.append(
                    {
                        "type": "file-reference",
                        "file_name": str(p["file_name"]),
                        "start_line": int(p["start_line"]),
                        "end_line": int(p["end_line"]),
                        "content": str(p["content"]),
                    }
                )
            except (KeyError, TypeError, ValueError):
                raise Refused(
                    400, "Invalid input part.", f"content[{i}] is not a valid file reference."
                ) from None
        else:
            raise Refused(400, "Invalid input part.", f"content[{i}].type {t!r} is not supported.")
    return out


def validate_dynamic_tools(tools: Any) -> list[dict[str, Any]]:
    """Dynamic tool checks: >250, empty name, duplicate."""
    if not tools:
        return []
    if not isinstance(tools, list):
        raise Refused(400, "Invalid dynamic tools.")
    if len(tools) > MAX_DYNAMIC_TOOLS:
        raise Refused(400, "Too many dynamic tools.")
    seen: set[str] = set()
    for t in tools:
        name = t.get("name") if isinstance(t, dict) else None
        if not name:
            raise Refused(400, "Dynamic tool name must not be empty.")
        if name in seen:
            raise Refused(400, "Duplicate dynamic tool name.", f"{name!r} is declared twice.")
        seen.add(name)
    return list(tools)


def positive_int(raw: str | None) -> int | None:
    """``PositiveInt32``-style query parsing: 400 ``Query parameters have invalid values.``."""
    if raw is None or raw == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise Refused(
            400, "Query parameters have invalid values.", f"{raw!r} is not an integer"
        ) from None
    if v < 0:
        raise Refused(400, "Query parameters have invalid values.", f"{raw!r} must be positive")
    return v


def split_query(q: str) -> list[tuple[str, str]]:
    """Split a ``q`` search string into key:value terms (quotes group a value)."""
    terms: list[tuple[str, str]] = []
    for m in re.finditer(r'(\S+?):("[^"]*"|\S*)|(\S+)', q):
        if m.group(3) is not None:
            raise Refused(400, "Invalid chat search query.", f"bare term {m.group(3)!r}")
        key, value = m.group(1).lower(), m.group(2).strip('"')
        terms.append((key, value))
    return terms

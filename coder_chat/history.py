# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""Chat history: rehydration to a transcript, paging, and crash-recovery reads.

Pure functions (``rehydrate``, ``count_marker_attempts``, ``recover_turn_result`` …)
take messages in any page order — plain dicts or ``models.ChatMessage`` — and
the async helpers (``fetch_until``, ``marker_attempts``, ``fetch_turn``) page
``GET /{id}/messages`` newest-first, 200 at a time via ``before_id``
(agent-semantics §9, durable-workflows "Recover the result").

History does not record which calls were client tools: every call
rehydrates as a :class:`DynamicToolPart`; classify by name against your own
client tool set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel

from coder_chat.core.attempts import StepAttempts
from coder_chat.core.translator import field, pending_client_calls, plain
from coder_chat.tools import pick_structured

if TYPE_CHECKING:
    from coder_chat.rest import ChatClient

__all__ = [
    "PAGE_SIZE",
    "DynamicToolPart",
    "FilePart",
    "ReasoningPart",
    "RecoveredTurn",
    "SourceUrlPart",
    "TextPart",
    "TranscriptMessage",
    "count_marker_attempts",
    "fetch_turn",
    "fetch_until",
    "final_text",
    "marker_attempts",
    "pending_client_calls",
    "recover_turn_result",
    "rehydrate",
    "structured_inputs",
]

PAGE_SIZE = 200

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str
    type: Literal["text"] = "text"
    state: Literal["done"] = "done"


@dataclass(frozen=True, slots=True)
class ReasoningPart:
    text: str
    type: Literal["reasoning"] = "reasoning"
    state: Literal["done"] = "done"


@dataclass(frozen=True, slots=True)
class DynamicToolPart:
    """A tool call with its folded result (if any).

    ``state``: ``output-available`` (``output`` = result), ``output-error``
    (``error_text``) or ``input-available`` (no result yet).
    """

    tool_name: str
    tool_call_id: str
    input: Any
    state: Literal["input-available", "output-available", "output-error"]
    output: Any = None
    error_text: str | None = None
    provider_executed: bool | None = None
    type: Literal["dynamic-tool"] = "dynamic-tool"


@dataclass(frozen=True, slots=True)
class SourceUrlPart:
    source_id: str
    url: str
    title: str | None = None
    type: Literal["source-url"] = "source-url"


@dataclass(frozen=True, slots=True)
class FilePart:
    url: str
    media_type: str
    filename: str | None = None
    type: Literal["file"] = "file"


TranscriptPart = TextPart | ReasoningPart | DynamicToolPart | SourceUrlPart | FilePart


@dataclass(frozen=True, slots=True)
class TranscriptMessage:
    """One rehydrated message (``id`` is the chat message id as a string)."""

    id: str
    role: str
    parts: list[TranscriptPart] = dc_field(default_factory=list)

    @property
    def message_id(self) -> int:
        return int(self.id)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))


def _id(message: Any) -> int:
    value = field(message, "id", 0)
    return value if isinstance(value, int) else int(value)


def _error_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    return json.dumps(result)


def _call_input(part: Any) -> Any:
    if isinstance(part, dict):
        return part.get("args")
    return plain(getattr(part, "args", None))


def rehydrate(
    messages: Iterable[Any], *, file_url: Callable[[Any], str | None] | None = None
) -> list[TranscriptMessage]:
    """Messages (any order) → chronological transcript (agent-semantics §9).

    Tool results from any message are folded into their call (first result per
    id wins); ``role: "tool"`` messages are dropped. ``file_url(part)`` may turn
    a ``file`` part into a URL; without one (and without ``part.url``) the file
    part is skipped.
    """
    ordered = sorted(messages, key=_id)
    results: dict[str, Any] = {}
    for msg in ordered:
        for part in field(msg, "content", []) or []:
            if field(part, "type") == "tool-result":
                cid = field(part, "tool_call_id")
                if isinstance(cid, str) and cid not in results:
                    results[cid] = part
    out: list[TranscriptMessage] = []
    for msg in ordered:
        role = field(msg, "role")
        if role == "tool":
            continue
        parts: list[TranscriptPart] = []
        for part in field(msg, "content", []) or []:
            ptype = field(part, "type")
            if ptype == "text":
                parts.append(TextPart(field(part, "text", "")))
            elif ptype == "reasoning":
                parts.append(ReasoningPart(field(part, "text", "")))
            elif ptype == "tool-call":
                cid = field(part, "tool_call_id")
                name = field(part, "tool_name")
                if not cid or not name:
                    continue
                res = results.get(cid)
                pe = field(part, "provider_executed")
                if pe is None and res is not None:
                    pe = field(res, "provider_executed")
                if res is None:
                    parts.append(
                        DynamicToolPart(
                            name, cid, _call_input(part), "input-available", provider_executed=pe
                        )
                    )
                elif field(res, "is_error"):
                    parts.append(
                        DynamicToolPart(
                            name,
                            cid,
                            _call_input(part),
                            "output-error",
                            error_text=_error_text(plain(field(res, "result"))),
                            provider_executed=pe,
                        )
                    )
                else:
                    parts.append(
                        DynamicToolPart(
                            name,
                            cid,
                            _call_input(part),
                            "output-available",
                            output=plain(field(res, "result")),
                            provider_executed=pe,
                        )
                    )
            elif ptype == "source":
                url = field(part, "url")
                if url:
                    parts.append(
                        SourceUrlPart(field(part, "source_id") or url, url, field(part, "title"))
                    )
            elif ptype == "file":
                url = (file_url(part) if file_url is not None else None) or field(part, "url")
                if url:
                    parts.append(
                        FilePart(
                            url,
                            field(part, "media_type") or "application/octet-stream",
                            field(part, "name"),
                        )
                    )
        out.append(TranscriptMessage(str(_id(msg)), str(role), parts))
    return out


# --------------------------------------------------------------------------- recovery reads


def count_marker_attempts(messages: Iterable[Any], marker: str) -> tuple[int, bool]:
    """Count user messages carrying ``marker``, contiguous at the tail of history.

    Returns ``(count, complete)``: ``complete`` is True when a user message
    *without* the marker was reached (so the count cannot grow by paging
    further back). Steps run sequentially, so one step's attempts sit together
    at the end of the chat. (:class:`coder_chat.core.attempts.StepAttempts`'s
    ``tail_attempts`` / ``tail_complete``.)
    """
    index = StepAttempts.of(messages, marker)
    return index.tail_attempts, index.tail_complete


async def fetch_until(
    client: ChatClient,
    chat_id: str,
    done: Callable[[list[Any]], bool],
    *,
    page_size: int = PAGE_SIZE,
    timeout: float | None = None,
) -> tuple[list[Any], bool]:
    """Page history newest-first until ``done(fetched)`` holds or history is exhausted.

    Returns ``(messages, complete)`` — ``complete`` is True if ``done`` held,
    or the whole history was read. Never conclude "absent" from a truncated read.
    """
    page = await client.get_messages(chat_id, limit=page_size, timeout=timeout)
    fetched: list[Any] = list(page.messages)
    while not done(fetched) and page.has_more and fetched:
        oldest = min(_id(m) for m in fetched)
        page = await client.get_messages(
            chat_id, before_id=oldest, limit=page_size, timeout=timeout
        )
        if not page.messages:
            break
        fetched.extend(page.messages)
    return fetched, done(fetched) or not page.has_more


async def marker_attempts(
    client: ChatClient,
    chat_id: str,
    marker: str,
    *,
    page_size: int = PAGE_SIZE,
    timeout: float | None = None,
) -> int:
    """How many committed attempts of a step (user messages carrying ``marker``,
    contiguous at the tail of the chat) the chat holds; history is paged back only
    until that count is certain."""
    messages, _ = await fetch_until(
        client,
        chat_id,
        lambda ms: StepAttempts.of(ms, marker).tail_complete,
        page_size=page_size,
        timeout=timeout,
    )
    return StepAttempts.of(messages, marker).tail_attempts


async def fetch_turn(
    client: ChatClient, chat_id: str, *, page_size: int = PAGE_SIZE, timeout: float | None = None
) -> list[Any]:
    """The newest turn: history paged back until its user message is on hand."""
    messages, _ = await fetch_until(
        client,
        chat_id,
        lambda ms: any(field(m, "role") == "user" for m in ms),
        page_size=page_size,
        timeout=timeout,
    )
    return messages


def _last_user_index(transcript: Sequence[TranscriptMessage], user_message_id: int | None) -> int:
    for i in range(len(transcript) - 1, -1, -1):
        m = transcript[i]
        if m.role != "user":
            continue
        if user_message_id is None or m.message_id == user_message_id:
            return i
    return -1


def final_text(parts: Sequence[TranscriptPart], client_tool_names: AbstractSet[str]) -> str:
    """Text after the last configured client-tool part — what ``generate().text`` returns."""
    cut = -1
    for i, p in enumerate(parts):
        if isinstance(p, DynamicToolPart) and p.tool_name in client_tool_names:
            cut = i
    return "".join(p.text for p in parts[cut + 1 :] if isinstance(p, TextPart))


def structured_inputs(parts: Sequence[TranscriptPart], tool_name: str) -> list[Any]:
    """Inputs of every ``tool_name`` call in ``parts``, in order."""
    return [p.input for p in parts if isinstance(p, DynamicToolPart) and p.tool_name == tool_name]


@dataclass(frozen=True, slots=True)
class RecoveredTurn:
    """What ``generate()`` would have returned for a turn, rebuilt from history."""

    user_message_id: int
    text: str
    parts: list[TranscriptPart]
    #: True when the user message's text carries the marker (if one was given).
    submitted: bool
    structured: Any = None


def recover_turn_result(
    messages: Iterable[Any],
    *,
    client_tool_names: AbstractSet[str],
    user_message_id: int | None = None,
    marker: str | None = None,
    output_model: type[BaseModel] | None = None,
    structured_tool_name: str = "structured_output",
) -> RecoveredTurn | None:
    """Rebuild a turn's result from history.

    The turn is the one started by ``user_message_id`` (default: the last user
    message). ``text`` joins the text parts after the last configured
    client-tool part; with ``output_model`` the last *validating*
    ``structured_output`` input is returned as ``structured``. ``None`` when no
    user message is on hand.
    """
    transcript = rehydrate(messages)
    idx = _last_user_index(transcript, user_message_id)
    if idx < 0:
        return None
    user = transcript[idx]
    parts: list[TranscriptPart] = []
    for later in transcript[idx + 1 :]:
        if later.role == "user":
            break  # the next turn (a promoted or later prompt) starts here
        if later.role == "assistant":
            parts.extend(later.parts)
    structured = None
    if output_model is not None:
        structured = pick_structured(output_model, structured_inputs(parts, structured_tool_name))
    return RecoveredTurn(
        user_message_id=user.message_id,
        text=final_text(parts, client_tool_names),
        parts=parts,
        submitted=True if marker is None else marker in user.text,
        structured=structured,
    )

"""Validate raw REST bodies and stream frames against ``wire_models`` (route → type).

``helpers.client`` and ``helpers.Tap`` call these on every response and frame, so every
conformance scenario doubles as a wire-shape check.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, TypeAdapter

from . import wire_models as wm

_CHATS = r"/api/(?:v2|experimental)/chats"
_ID = r"[^/]+"

# (method, path regex, success model); a list body uses a TypeAdapter.
_ROUTES: list[tuple[str, str, Any]] = [
    ("POST", rf"{_CHATS}", wm.Chat),
    ("GET", rf"{_CHATS}", TypeAdapter(list[wm.Chat])),
    ("POST", rf"{_CHATS}/files", wm.UploadChatFileResponse),
    ("GET", rf"{_CHATS}/files/{_ID}", None),  # raw bytes
    ("GET", rf"{_CHATS}/{_ID}", wm.Chat),
    ("PATCH", rf"{_CHATS}/{_ID}", None),  # 204
    ("GET", rf"{_CHATS}/{_ID}/messages", wm.ChatMessagesResponse),
    ("POST", rf"{_CHATS}/{_ID}/messages", wm.CreateChatMessageResponse),
    ("PATCH", rf"{_CHATS}/{_ID}/messages/{_ID}", wm.EditChatMessageResponse),
    ("POST", rf"{_CHATS}/{_ID}/tool-results", None),  # 204
    ("POST", rf"{_CHATS}/{_ID}/interrupt", wm.Chat),
    ("DELETE", rf"{_CHATS}/{_ID}/queue/{_ID}", None),  # 204
    ("POST", rf"{_CHATS}/{_ID}/queue/{_ID}/promote", wm.ErrorEnvelope),  # {"message"}
    ("GET", r"/api/v2/organizations/[^/]+/chats/models", wm.ChatModelsResponse),
]
_COMPILED = [(m, re.compile(p + r"/?\Z"), model) for m, p, model in _ROUTES]
_FRAME = TypeAdapter(list[wm.StreamEvent])


def _validate(model: Any, body: Any) -> None:
    if isinstance(model, TypeAdapter):
        model.validate_python(body)
    elif isinstance(model, type) and issubclass(model, BaseModel):
        model.model_validate(body)


def check_rest(method: str, path: str, status: int, body: Any) -> None:
    """Validate one chat-API response body; raises ``pydantic.ValidationError``."""
    if not path.startswith(("/api/v2/chats", "/api/experimental/chats", "/api/v2/org")):
        return  # helpers (buildinfo, users/me), the AI Gateway, the control API
    if status >= 300:
        if status != 101:
            wm.ErrorEnvelope.model_validate(body)
        return
    for m, rx, model in _COMPILED:
        if m == method and rx.match(path):
            if model is not None:
                _validate(model, body)
            return
    raise AssertionError(f"no wire type for {method} {path} ({status})")


def check_frame(frame: Any) -> None:
    """Validate one stream text frame (a JSON array of ``ChatStreamEvent``)."""
    assert isinstance(frame, list) and 0 < len(frame) <= 256, frame
    _FRAME.validate_python(frame)


def check_watch(event: Any) -> None:
    """Validate one watch text frame (a single ``ChatWatchEvent`` object)."""
    wm.WatchEvent.model_validate(event)

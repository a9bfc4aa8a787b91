"""Reading wire values that may be decoded JSON dicts or pydantic models.

Stream events reach the pure cores either as plain dicts (tests, recovered
history) or as :mod:`coder_chat.models` objects; these helpers read both the
same way, so no core has to care which one it was handed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["canonical_json", "field", "int_or_none", "plain", "tool_args_json"]

_IS_MAPPING: dict[type, bool] = {dict: True}


def field(obj: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict or an attribute-style model; ``None`` → ``default``."""
    if obj is None:
        return default
    # Hot path (every stream event): the Mapping ABC check is memoised per type.
    cls = type(obj)
    is_mapping = _IS_MAPPING.get(cls)
    if is_mapping is None:
        is_mapping = _IS_MAPPING[cls] = issubclass(cls, Mapping)
    value = obj.get(key) if is_mapping else getattr(obj, key, None)
    return default if value is None else value


def plain(obj: Any) -> Any:
    """A JSON-shaped copy of ``obj`` with ``None`` values dropped (models are dumped)."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump) and not isinstance(obj, type):
        obj = dump(mode="json", exclude_none=True, by_alias=True)
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> str:
    """Canonical JSON (keys sorted recursively, ``None`` dropped) used for content equality."""
    return json.dumps(plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def int_or_none(value: Any) -> int | None:
    """``value`` if it is a real ``int`` (``bool`` excluded), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def tool_args_json(part: Any) -> str:
    """A committed ``tool-call`` part's arguments as the JSON *string* ``action_required`` carries.

    Absent arguments become ``{}``; an explicit JSON ``null`` is preserved
    (agent-semantics §3.5).
    """
    if isinstance(part, Mapping):
        args = part["args"] if "args" in part else {}
    else:
        args = getattr(part, "args", {})
        if args is None and "args" not in (getattr(part, "model_fields_set", set()) or set()):
            args = {}
    if isinstance(args, str | bytes):
        return args.decode() if isinstance(args, bytes) else args
    return json.dumps(plain(args) if args is not None else None)

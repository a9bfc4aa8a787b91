"""Token/cost accounting for a turn (spec agent-semantics §3.7). Pure, no I/O.

The wire ``usage`` object on an assistant message counts *uncached* input in
``input_tokens``; the normalised :class:`Usage` reports the total input
(uncached + cache reads + cache writes) the way the AI SDK does, and keeps the
summed wire dict in :attr:`Usage.raw`.

A message's usage is keyed by its id: a revised snapshot of the same message
replaces the earlier numbers instead of adding to them, so reconnect replays
never double-count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Wire fields that are summed across messages (and across segments).
SUMMED_FIELDS: tuple[str, ...] = (
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "reasoning_tokens",
    "cache_creation_tokens",
    "cache_read_tokens",
    "total_cost_micros",
    "total_runtime_ms",
)


def _num(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    return None


def _merge_raw(into: dict[str, Any], wire: Mapping[str, Any]) -> None:
    """Fold one wire usage dict into ``into``: summed fields add, others overwrite."""
    for key, value in wire.items():
        if value is None:
            continue
        if key in SUMMED_FIELDS:
            n = _num(value)
            if n is None:
                continue
            into[key] = _num(into.get(key)) or 0
            into[key] += n
        else:
            # context_limit and unknown fields: the newest message wins.
            into[key] = value


@dataclass(frozen=True, slots=True)
class Usage:
    """Normalised usage of a segment or a whole turn.

    ``input_tokens`` is the total input (uncached + cache read + cache write);
    ``no_cache_input_tokens`` is the wire ``input_tokens``. Fields absent from
    every contributing message stay ``None``.
    """

    input_tokens: int | None = None
    no_cache_input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_creation_tokens: int | None = None
    total_cost_micros: int | None = None
    total_runtime_ms: int | None = None
    context_limit: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> Usage:
        """Build the normalised view of an (already summed) wire usage dict."""
        raw = dict(raw)
        uncached = _num(raw.get("input_tokens"))
        cache_read = _num(raw.get("cache_read_tokens"))
        cache_write = _num(raw.get("cache_creation_tokens"))
        parts = [v for v in (uncached, cache_read, cache_write) if v is not None]
        return cls(
            input_tokens=sum(parts) if parts else None,
            no_cache_input_tokens=uncached,
            output_tokens=_num(raw.get("output_tokens")),
            total_tokens=_num(raw.get("total_tokens")),
            reasoning_tokens=_num(raw.get("reasoning_tokens")),
            cache_read_tokens=cache_read,
            cache_creation_tokens=cache_write,
            total_cost_micros=_num(raw.get("total_cost_micros")),
            total_runtime_ms=_num(raw.get("total_runtime_ms")),
            context_limit=_num(raw.get("context_limit")),
            raw=raw,
        )

    def __add__(self, other: Usage) -> Usage:
        merged: dict[str, Any] = dict(self.raw)
        _merge_raw(merged, other.raw)
        return Usage.from_raw(merged)

    @property
    def is_empty(self) -> bool:
        """True when no message contributed any usage."""
        return not self.raw


def usage_of_messages(by_message_id: Mapping[int, Mapping[str, Any]]) -> Usage:
    """Sum per-message wire usage dicts, oldest id first (newest wins for non-summed fields)."""
    merged: dict[str, Any] = {}
    for message_id in sorted(by_message_id):
        _merge_raw(merged, by_message_id[message_id])
    return Usage.from_raw(merged)


def sum_usages(usages: Iterable[Usage]) -> Usage:
    """Turn usage = sum over its segments."""
    total = Usage()
    for u in usages:
        total = total + u
    return total

"""The text ledger: stream text once, never twice, never lose a tail.

Text and reasoning reach the client twice: as deltas while the model writes
(no message id) and as the committed assistant message (a snapshot with the
full content). A reconnect replays deltas and snapshots, and a message can be
committed while the client is disconnected. The ledger keeps, per message id,
what was already emitted, so (agent-semantics §3.6):

* deltas are emitted at once and kept as *pending*;
* the next assistant snapshot *claims* the pending deltas and emits only its
  missing suffix (nothing for a trailing snapshot, everything for a
  snapshot-only message, the tail for a message committed during a reconnect);
* a later, strictly extending revision of a known message emits its suffix as
  a separate block; identical replays and rewrites emit nothing; a revision
  racing the next step's open deltas is deferred until ownership settles;
* a ``retry`` voids the failed attempt's pending preview, and so does a new
  generation attempt of the same history version;
* once a step commits, its delta episode is closed: a late replay of its
  preview never becomes new pending text. The closed-episode set is shared by
  the segments of one turn (a resume segment reads the same stream).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Literal

from coder_chat.core.fields import field
from coder_chat.core.parts import Part, ReasoningDelta, TextDelta

__all__ = ["Episode", "TextKind", "TextLedger"]

#: ``(history_version, generation_attempt)`` of a delta; ``(None, None)`` on old servers.
Episode = tuple[Any, Any]
TextKind = Literal["text", "reasoning"]


@dataclass(slots=True)
class _Block:
    text: str
    message_id: int | None  # None = pending (not yet claimed by a snapshot)
    episode: Episode | None = None


@dataclass(slots=True)
class _Emitted:
    text: str = ""
    reasoning: str = ""


@dataclass(slots=True)
class _Blocks:
    """The emitted blocks of one kind, committed ones first, pending ones last."""

    blocks: list[_Block] = dc_field(default_factory=list)
    episode: Episode | None = None  # episode of the pending deltas

    def pending(self) -> str:
        out: list[str] = []
        for block in reversed(self.blocks):
            if block.message_id is not None:
                break
            out.append(block.text)
        return "".join(reversed(out))

    def first_pending_episode(self) -> Episode | None:
        first = None
        for block in reversed(self.blocks):
            if block.message_id is not None:
                break
            first = block.episode
        return first

    def drop_pending(self) -> None:
        while self.blocks and self.blocks[-1].message_id is None:
            self.blocks.pop()

    def append_committed(self, block: _Block) -> None:
        """Add a committed block before any pending (unclaimed) deltas."""
        i = len(self.blocks)
        while i > 0 and self.blocks[i - 1].message_id is None:
            i -= 1
        self.blocks.insert(i, block)

    def has_pending(self) -> bool:
        return bool(self.blocks) and self.blocks[-1].message_id is None

    def text(self) -> str:
        return "".join(b.text for b in self.blocks)


def _joined(content: Any, kind: str) -> str:
    return "".join(
        field(part, "text", "") for part in (content or ()) if field(part, "type") == kind
    )


class TextLedger:
    """Text and reasoning of one segment, reconciled between deltas and snapshots.

    Args:
        closed_episodes: episodes whose step already committed (a live set shared
            by the segments of one turn); late replays of their deltas are ignored.
    """

    def __init__(self, closed_episodes: set[Episode] | None = None) -> None:
        self._text = _Blocks()
        self._reasoning = _Blocks()
        self._emitted: dict[int, _Emitted] = {}
        self._closed_episodes: set[Episode] = (
            closed_episodes if closed_episodes is not None else set()
        )
        self._deferred: dict[int, tuple[str, str]] = {}

    @property
    def text(self) -> str:
        """Text so far (committed blocks, then pending deltas), in order."""
        return self._text.text()

    @property
    def reasoning(self) -> str:
        """Reasoning so far."""
        return self._reasoning.text()

    @property
    def closed_episodes(self) -> set[Episode]:
        return self._closed_episodes

    def delta(self, kind: TextKind, text: str, episode: Episode) -> list[Part]:
        """A text/reasoning delta: emit it now, keep it pending until a snapshot claims it."""
        if not text:
            return []
        blocks = self._text if kind == "text" else self._reasoning
        if episode[0] is not None and episode in self._closed_episodes:
            # A committed step's episode is over: a late replay of its preview
            # (e.g. re-sent after a reconnect) must not become new pending text.
            return []
        if (
            blocks.has_pending()
            and blocks.episode is not None
            and episode[0] is not None
            and blocks.episode[0] == episode[0]
            and blocks.episode[1] != episode[1]
        ):
            # Same history, new generation attempt: the old attempt's preview is void.
            blocks.drop_pending()
        blocks.episode = episode
        blocks.blocks.append(_Block(text, None, episode))
        return [TextDelta(text) if kind == "text" else ReasoningDelta(text)]

    def drop_pending(self) -> None:
        """A ``retry``: the failed attempt's previewed text will never be committed."""
        self._text.drop_pending()
        self._reasoning.drop_pending()

    def commit(self, message_id: int, content: Any) -> list[Part]:
        """An assistant snapshot (new message or revision); emit only what is new."""
        full_text = _joined(content, "text")
        full_reasoning = _joined(content, "reasoning")
        emitted = self._emitted.get(message_id)
        out: list[Part] = []
        if emitted is None:
            out.extend(self.flush())
            self._emitted[message_id] = _Emitted(full_text, full_reasoning)
            for blocks in (self._text, self._reasoning):
                closed = blocks.first_pending_episode() if blocks.has_pending() else None
                if closed is not None and closed[0] is not None:
                    self._closed_episodes.add(closed)
            out.extend(_claim(self._reasoning, message_id, full_reasoning, ReasoningDelta))
            out.extend(_claim(self._text, message_id, full_text, TextDelta))
            return out
        extends = (full_text.startswith(emitted.text) and len(full_text) > len(emitted.text)) or (
            full_reasoning.startswith(emitted.reasoning)
            and len(full_reasoning) > len(emitted.reasoning)
        )
        if not extends:
            return []  # identical replay or a rewrite: nothing new to say
        if self._text.has_pending() or self._reasoning.has_pending():
            # The next step's deltas are open; emit once ownership settles.
            self._deferred[message_id] = (full_text, full_reasoning)
            return []
        return self._extend(message_id, full_text, full_reasoning)

    def flush(self) -> list[Part]:
        """Emit deferred revisions (at segment end, before an error or a promotion)."""
        out: list[Part] = []
        deferred, self._deferred = self._deferred, {}
        for mid in sorted(deferred):
            out.extend(self._extend(mid, *deferred[mid]))
        return out

    def _extend(self, mid: int, full_text: str, full_reasoning: str) -> list[Part]:
        emitted = self._emitted[mid]
        out: list[Part] = []
        if full_reasoning.startswith(emitted.reasoning) and len(full_reasoning) > len(
            emitted.reasoning
        ):
            tail = full_reasoning[len(emitted.reasoning) :]
            self._reasoning.append_committed(_Block(tail, mid))
            emitted.reasoning = full_reasoning
            out.append(ReasoningDelta(tail, mid))
        if full_text.startswith(emitted.text) and len(full_text) > len(emitted.text):
            tail = full_text[len(emitted.text) :]
            self._text.append_committed(_Block(tail, mid))
            emitted.text = full_text
            out.append(TextDelta(tail, mid))
        return out


def _claim(
    blocks: _Blocks, mid: int, full: str, make: Callable[[str, int], TextDelta | ReasoningDelta]
) -> list[Part]:
    claimed = blocks.pending()
    if full.startswith(claimed):
        for block in reversed(blocks.blocks):
            if block.message_id is not None:
                break
            block.message_id = mid
        tail = full[len(claimed) :]
        if tail:
            blocks.blocks.append(_Block(tail, mid))
            return [make(tail, mid)]
        return []
    blocks.drop_pending()
    if claimed.startswith(full):
        # Deltas of the next message already arrived: keep that remainder pending.
        if full:
            blocks.blocks.append(_Block(full, mid))
        blocks.blocks.append(_Block(claimed[len(full) :], None))
        return []
    # A rewrite: the committed text is the truth; nothing more to emit.
    if full:
        blocks.blocks.append(_Block(full, mid))
    return []

"""An agent's session: which chat, how far it was read, what it left behind.

One mutable record shared by :class:`~coder_chat.agent.CoderAgent` (session
operations, the turn loop), :class:`~coder_chat.segment_runner.SegmentRunner`
(which advances the cursor, retains the stream, strands and discards) and
:mod:`coder_chat.agent_cleanup` (archive clears what it retired). The rules
each mutation follows live with the code that makes it; this module only says
what a reset forgets and what it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coder_chat.stream import ChatStreamReader

__all__ = ["AgentSession"]


@dataclass(slots=True)
class AgentSession:
    """The session's state (internal to the agent).

    ``chat_id``/``cursor``: the chat and the resume cursor (0: unknown).
    ``last_known_chat_id``: cleanup target, survives resets until archived.
    ``stranded``: chats dropped by discards, not yet archived (insertion order).
    ``submitted``: tool-call ids whose results went out (never posted twice).
    ``assigned_workspace``/``assigned_mcp``: what the server gave a chat this
    agent created (a stream failure's retry verdict reads them).
    ``reader``: the stream retained between segments of the session's chat;
    ``active_reader``: the one a segment is reading now.
    """

    chat_id: str | None = None
    cursor: int = 0
    last_known_chat_id: str | None = None
    stranded: dict[str, None] = field(default_factory=dict)
    submitted: set[str] = field(default_factory=set)
    assigned_workspace: str | None = None
    assigned_mcp: list[str] = field(default_factory=list)
    reader: ChatStreamReader | None = None
    active_reader: ChatStreamReader | None = None

    def reset(self) -> None:
        """Forget the chat (id, cursor, submissions, retained stream); keep
        ``last_known_chat_id`` and the stranded chats."""
        self.chat_id = None
        self.cursor = 0
        self.submitted = set()
        self.assigned_workspace = None
        self.assigned_mcp = []
        self.close_reader_nowait()

    def discard(self, chat_id: str | None) -> None:
        """Reset, if the session is still on ``chat_id``."""
        if chat_id is not None and self.chat_id == chat_id:
            self.reset()

    def close_reader_nowait(self) -> None:
        """Close the retained stream (if any) without waiting."""
        if self.reader is not None:
            self.reader.close_nowait()
            self.reader = None

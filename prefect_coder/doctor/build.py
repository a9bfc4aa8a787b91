"""Which Coder server build answers: B1, B2 or B3 (docs/client.md, "Supported Coder builds").

Pure. Two read-only answers tell the three builds apart (``coder_chat/emulator/eras.py``
plays each):

=====================================  ==========  ==========  ==========
probe                                   B1          B2          B3
=====================================  ==========  ==========  ==========
GET /api/experimental/chats?limit=1     200         200         404
GET /api/v2/chats?limit=1&q=status:…    400         200         200
=====================================  ==========  ==========  ==========

and ``GET /api/v2/chats?limit=1`` must answer 200 on all three. Anything else is an
unsupported build (older: chats only under ``/api/experimental``; none at all: no chat
API) or an unrecognised one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .observed import Answer

__all__ = ["BUILDS", "BuildGuess", "infer_build"]

#: Build → (commit the spec read, what tells it apart).
BUILDS = {
    "B1": ("004053e8", "chats on /api/v2 and /api/experimental, `q=status:` rejected (400)"),
    "B2": ("18e18bf9", "chats on /api/v2 and /api/experimental, `q=status:` accepted"),
    "B3": ("38c471cf", "chats on /api/v2 only (/api/experimental 404), `q=status:` accepted"),
}


@dataclass(frozen=True, slots=True)
class BuildGuess:
    """``build`` is ``"B1"``/``"B2"``/``"B3"``, or None with ``problem`` saying why:
    ``"no-chat-api"``, ``"experimental-only"`` or ``"unrecognised"``."""

    build: str | None
    problem: str | None = None

    @property
    def label(self) -> str:
        """``B3 (38c471cf or later)``-style name, or the problem."""
        if self.build is None:
            return self.problem or "unknown"
        commit, _ = BUILDS[self.build]
        return f"{self.build} ({commit}{' or later' if self.build == 'B3' else ''})"


def infer_build(v2_list: Answer, experimental_list: Answer, status_query: Answer) -> BuildGuess:
    """The build from the three listing answers (none of them may be a 5xx or a 401)."""
    v2, exp, sq = v2_list.status, experimental_list.status, status_query.status
    if v2 == 404:
        if exp == 200:
            return BuildGuess(None, "experimental-only")
        return BuildGuess(None, "no-chat-api")
    if v2 != 200:
        return BuildGuess(None, "unrecognised")
    if exp == 200 and sq == 400:
        return BuildGuess("B1")
    if exp == 200 and sq == 200:
        return BuildGuess("B2")
    if exp == 404 and sq == 200:
        return BuildGuess("B3")
    return BuildGuess(None, "unrecognised")

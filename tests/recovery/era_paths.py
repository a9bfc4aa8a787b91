"""Opt-in pytest plugin (an analysis aid, not a test): which tests make an in-process
emulator take a branch whose outcome differs by Coder build.

``PYTHONPATH=tests/recovery pytest -p era_paths tests/recovery`` (any era) writes
``$ERA_PATHS_OUT`` (default ``era-paths.tsv``): one line ``nodeid<TAB>branch<TAB>count``
per test and branch. The branches are those of
``coder_chat/emulator/eras.py`` that a client can observe:

* ``dial_with_revision_cursor``: a stream dial carrying ``after_revision`` /
  ``history_version`` (a redial after a ``status`` event's version; B1 has none);
* ``queue_head_promoted``: a queued prompt promoted (``queued_message_id`` on B2+);
* ``unowned_interrupt``: an interrupt or interrupting send of a running chat no
  emulator worker holds (finished at once on B3);
* ``listing_query:<q>``: a listing query B1 refuses (``status:``, ``archived:any``,
  ``search:``, ``pr_status:none``);
* ``create_title_or_empty``: a create with a title or without content;
* ``patch_refused``: a PATCH refused by B3's validate-first (visible at B3 only).

``dial_after_id_only`` is counted too (the same on every build), to show the
plugin saw the test's streams. It wraps emulator methods for the session: use it
for analysis runs only. scripts/test's header says what it found for
tests/recovery and how that picks the b1 pass's tests.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from coder_chat.emulator import config as _config
from coder_chat.emulator import core as _core
from coder_chat.emulator import routes as _routes

_current = {"id": "(outside a test)"}
_lock = threading.Lock()
_seen: dict[str, dict[str, int]] = {}


def _count(branch: str) -> None:
    with _lock:
        per_test = _seen.setdefault(_current["id"], {})
        per_test[branch] = per_test.get(branch, 0) + 1


def _install() -> None:
    owned = _core.Core._owned

    def _owned(self: Any, chat: Any) -> bool:
        if not chat.owned and chat.status in ("running", "interrupting"):
            _count("unowned_interrupt")
        return owned(self, chat)

    _core.Core._owned = _owned  # type: ignore[method-assign]

    stamps = _config.Config.stamps_queued_message_id

    def _stamps(self: Any) -> bool:
        _count("queue_head_promoted")
        return bool(stamps.fget(self))  # type: ignore[attr-defined]

    _config.Config.stamps_queued_message_id = property(_stamps)  # type: ignore[assignment,method-assign]

    stream = _routes.Api._stream

    def _stream(self: Any, req: Any, user: Any, chat: Any) -> Any:
        if req.param("after_revision") or req.param("history_version"):
            _count("dial_with_revision_cursor")
        else:
            _count("dial_after_id_only")
        return stream(self, req, user, chat)

    _routes.Api._stream = _stream  # type: ignore[method-assign]

    list_chats = _routes.list_chats

    def _list_chats(core: Any, req: Any, user: Any) -> Any:
        q = " ".join(req.query.get("q", []))
        if any(k in q for k in ("status:", "archived:any", "search:", "pr_status:none")):
            _count(f"listing_query:{q}")
        return list_chats(core, req, user)

    _routes.list_chats = _list_chats

    create = _routes.Api._create

    def _create(self: Any, req: Any, user: Any) -> Any:
        body = self._body(req)
        if isinstance(body, dict) and (body.get("title") or not body.get("content")):
            _count("create_title_or_empty")
        return create(self, req, user)

    _routes.Api._create = _create  # type: ignore[method-assign]

    validate = _routes._validate_patch

    def _validate_patch(body: Any, chat: Any) -> None:
        try:
            validate(body, chat)
        except Exception:
            _count("patch_refused")
            raise

    _routes._validate_patch = _validate_patch


_install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # Module- and session-scoped fixtures count under the first test that needs them.
    _current["id"] = item.nodeid


def pytest_unconfigure(config: pytest.Config) -> None:
    out = os.environ.get("ERA_PATHS_OUT", "era-paths.tsv")
    with open(out, "w") as fh:
        for nodeid, branches in sorted(_seen.items()):
            for branch, n in sorted(branches.items()):
                fh.write(f"{nodeid}\t{branch}\t{n}\n")

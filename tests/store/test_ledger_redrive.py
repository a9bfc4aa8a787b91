"""The ledger never turns a repeat of an applied-but-unreported call into a fresh effect
(issue 30, items 1 and 4), on real SQLite and PostgreSQL:

* a ``committing`` entry of an identical call — of an earlier attempt of the step
  (count-based) or of this attempt (not still running) — makes the new call a
  re-drive of THAT call (``replay_of``, state ``committing``);
* entries written by older code (no step attempt, no fingerprint: written here with
  the store's own SQL, an UPDATE that NULLs the columns as a previous version's rows
  have them) count as applied calls unless proven different.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry, LedgerEntry
from prefect_coder.blocks.state.schema import tool_ledger

MARKER = "[wf/pay]"


async def _journal(
    store: StateStore, chat: str, state: str, attempt: int, *, at: float | None = None
) -> None:
    entry = JournalEntry(state=state, marker=MARKER, attempt=attempt, at=at or time.time())  # type: ignore[arg-type]
    await store.journal.set(chat, entry)


async def _begin(
    store: StateStore,
    chat: str,
    call: str,
    cents: int,
    *,
    tool: str = "charge_card",
    in_flight: frozenset[str] = frozenset(),
) -> LedgerEntry:
    entry, created = await store.ledger.begin(
        chat,
        call,
        tool_name=tool,
        args={"amount_cents": cents},
        match_earlier_attempts=True,
        in_flight=in_flight,
    )
    assert created
    return entry


def _shape(entry: LedgerEntry) -> tuple[str, str | None, int | None]:
    return entry.state, entry.replay_of, entry.attempt


async def _as_older_code(store: StateStore, chat: str, **columns: Any) -> None:
    """Rewrite a chat's rows as a worker of the previous schema wrote them."""
    values = {"marker": None, "attempt": None, "args_fp": None, "replay_of": None, **columns}
    async with store.write() as conn:
        await conn.execute(
            sa.update(tool_ledger)
            .where(tool_ledger.c.tenant == store.tenant, tool_ledger.c.chat_id == chat)
            .values(**values)
        )


async def test_committing_call_of_an_earlier_attempt_is_redriven_not_repeated(
    store: StateStore,
) -> None:
    chat = "chat-1"
    await _journal(store, chat, "submitting", 0)
    # The effect ran, the `done` write failed: the entry stays committing.
    assert _shape(await _begin(store, chat, "a0", 700)) == ("committing", None, 0)
    # A structured re-ask (a new journaled send) makes the model call it again.
    await _journal(store, chat, "submitting", 1)
    assert _shape(await _begin(store, chat, "a1", 700)) == ("committing", "a0", 1)
    # Other arguments are another call: a fresh effect.
    assert _shape(await _begin(store, chat, "a1-other", 701)) == ("committing", None, 1)
    # While that re-drive has not reported, a further repeat goes to the same call.
    assert _shape(await _begin(store, chat, "a1-again", 700)) == ("committing", "a0", 1)
    # Re-driven and recorded (the earlier call and the repeats): count-based, as for
    # done entries, one more repeat has nothing left to match and runs.
    for call in ("a0", "a1", "a1-again"):
        await store.ledger.complete(chat, call, {"receipt": "r-a0"})
    assert _shape(await _begin(store, chat, "a1-third", 700)) == ("committing", None, 1)
    # Later attempts answer from the record.
    await _journal(store, chat, "submitting", 2)
    replay = await _begin(store, chat, "a2", 700)
    assert _shape(replay) == ("done", "a0", 2) and replay.output == {"receipt": "r-a0"}


async def test_a_repeat_within_the_attempt_redrives_the_unreported_call(
    store: StateStore,
) -> None:
    chat = "chat-2"
    await _journal(store, chat, "submitting", 0)
    assert _shape(await _begin(store, chat, "c1", 500)) == ("committing", None, 0)
    # A sibling of the same tool round while c1 still runs: two calls, two effects.
    sibling = await _begin(store, chat, "c2", 500, in_flight=frozenset({"c1"}))
    assert _shape(sibling) == ("committing", None, 0)
    # c1's effect raised (unknown outcome) and nothing runs now: the model's repeat
    # is re-driven under c1's key — the oldest unreported one.
    assert _shape(await _begin(store, chat, "c3", 500)) == ("committing", "c1", 0)
    # A repeat of a repeat that did not report either goes to the same root call.
    assert _shape(await _begin(store, chat, "c4", 500, in_flight=frozenset({"c2"}))) == (
        "committing",
        "c1",
        0,
    )
    # Every call reported: identical calls within one attempt run normally again.
    for call in ("c1", "c2", "c3", "c4"):
        await store.ledger.complete(chat, call, {"receipt": call})
    assert _shape(await _begin(store, chat, "c5", 500)) == ("committing", None, 0)


async def test_rows_of_older_code_are_never_repeated_as_a_fresh_effect(
    store: StateStore,
) -> None:
    chat = "chat-3"
    await _journal(store, chat, "submitting", 0, at=time.time() - 60)
    await _begin(store, chat, "old-done", 250)
    await store.ledger.complete(chat, "old-done", {"receipt": "old"})
    await _begin(store, chat, "old-committing", 250)
    await _begin(store, chat, "old-other", 30)
    await _begin(store, chat, "old-lookup", 250, tool="lookup")
    await store.ledger.complete(chat, "old-lookup", {"found": True})
    await _as_older_code(store, chat)
    old = await store.ledger.get(chat, "old-done")
    assert old is not None and (old.marker, old.attempt) == (None, None)
    # A resubmission by the new code: the same calls are answered / re-driven.
    await _journal(store, chat, "submitting", 1)
    first = await _begin(store, chat, "n1", 250)
    assert _shape(first) == ("done", "old-done", 1) and first.output == {"receipt": "old"}
    assert _shape(await _begin(store, chat, "n2", 250)) == ("committing", "old-committing", 1)
    assert _shape(await _begin(store, chat, "n3", 30)) == ("committing", "old-other", 1)
    # ...and what is proven different runs: another tool, other arguments, one more.
    assert _shape(await _begin(store, chat, "n4", 250, tool="refund")) == ("committing", None, 1)
    assert _shape(await _begin(store, chat, "n5", 99)) == ("committing", None, 1)
    for call in ("old-committing", "n2"):  # the re-drive reported
        await store.ledger.complete(chat, call, {"receipt": "old-committing"})
    assert _shape(await _begin(store, chat, "n6", 250)) == ("committing", None, 1)


async def test_an_older_row_that_cannot_be_told_apart_is_redriven_not_replayed(
    store: StateStore,
) -> None:
    chat = "chat-4"
    await _journal(store, chat, "submitting", 0, at=time.time() - 60)
    await _begin(store, chat, "anon", 250)
    await store.ledger.complete(chat, "anon", {"something": "else"})
    # No tool name, no arguments: nothing proves it is another call — but nothing
    # proves it is this one either, so its output is not handed out: re-drive its key.
    await _as_older_code(store, chat, tool_name=None, args_json=None)
    await _journal(store, chat, "submitting", 1)
    assert _shape(await _begin(store, chat, "n1", 250)) == ("committing", "anon", 1)


async def test_an_older_row_written_before_the_step_began_is_another_step(
    store: StateStore,
) -> None:
    chat = "chat-5"
    await _journal(store, chat, "submitting", 0, at=time.time() - 60)
    await _begin(store, chat, "step1", 250)
    await store.ledger.complete(chat, "step1", {"receipt": "step1"})
    await _as_older_code(store, chat)
    # The next step's first send is journaled after the row: the same charge is a new
    # one (the entry's `at` only dates the step's start on its first attempt).
    await _journal(store, chat, "submitting", 0, at=time.time() + 1)
    assert _shape(await _begin(store, chat, "step2", 250)) == ("committing", None, 0)

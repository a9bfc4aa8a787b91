"""An abandoned turn slot is not taken at once when the probe of its workflow's chats
fails: the "could not tell" rule passes a lapsed slot on only once it has lapsed a
whole ttl.

A turn that fails while its run may go on server-side (a lost response to a landed
send) abandons its slot: it lapses at once, unreleased, and a waiter judges it — taken
once the workflow's chats are at rest. When the waiter cannot tell (its ``GET /chats``
probe fails or times out), ``slot_takeover`` used to take a lapsed slot anyway,
reasoning that a whole ttl had gone by without a renewal. An abandoned slot had no ttl
go by, and the probe fails most likely for the same reason the turn did (the Coder
server slow or unreachable): the waiter's turn started next to the left run (2 at cap
1). Now such a slot passes on a ttl after it lapsed.

Real parts: the emulator's fault API loses the response of the step's
``POST …/messages`` and holds every ``GET`` under ``/api/v2/chats`` longer than the
probe's bound (``PROBE``, set for this process through
``PREFECT_CODER_SLOT_PROBE_TIMEOUT_S``; the turns' own requests have 15 s); two in-process
fan-outs on one store (SQLite) and the session's Prefect test server; the count of
running turns is the emulator's event log.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from slot_env import left_and_other_after_a_lost_response
from support.prefect_blocks import save_settings

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials
from prefect_coder.flows.fleet.takeover import PROBE_TIMEOUT_ENV

#: The probe's bound in this test (with the default, 5 s, the test waited about twice as
#: long: the times below all follow from it).
PROBE = 1.0
#: How long the left run goes on server-side: past the probe's bound. The old rule took
#: the slot once the first probe failed, PROBE after the abandon (the abandon follows
#: b's landed send by milliseconds): `other` then started next to b's run with 5 s of
#: margin for that take and its send on a loaded machine.
B_RUNS_S = PROBE + 5.0
#: The slot ttl: a slot nobody can judge passes on once it has lapsed this long. b's run
#: ends less than B_RUNS_S after the abandon (its send landed first), so a take after
#: TTL comes after it; and the waiter takes only when a probe begun past the TTL has
#: failed (every probe is held past its bound here), at least TTL + PROBE after the
#: abandon: 3 s after b's run ended. A loaded machine only makes it later.
TTL = B_RUNS_S + 2.0


async def test_an_abandoned_slot_is_not_taken_when_its_chats_cannot_be_probed(
    prefect_server: Path,
    emu: Emulator,
    creds: CoderCredentials,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fan-outs below run in this process: their probes read it from here.
    monkeypatch.setenv(PROBE_TIMEOUT_ENV, str(PROBE))
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    tenant = f"abandon-{uuid.uuid4().hex[:8]}"
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 60.0, "turn_slot_ttl": TTL}
    )
    # keep_chat: b is sent on the chat of `left`'s first step (POST …/messages, the
    # request whose response the emulator loses).
    settings = await save_settings("abandon", capped, store_url, tenant=tenant, keep_chat=True)
    left_out, other_out, _ = await left_and_other_after_a_lost_response(
        emu, settings, store_url, tenant, b_runs_s=B_RUNS_S, probes_fail_for_s=PROBE + 1.0
    )

    # The case under test happened: b's answer was lost and its turn failed
    # transiently (retries 0), leaving its run live for recovery to follow.
    assert [o.ok for o in left_out] == [False], left_out
    assert [o.ok for o in other_out] == [True], other_out
    # The cap counts turns running on the server: `other`'s turn must not start while
    # b's run goes on there, whether or not the waiter could ask the server about it.
    log = emu.event_log(["turn_start", "turn_end"])
    assert emu.max_concurrent_turns() == 1, [
        (e["kind"], e["chat_id"], round(e["mono"], 2)) for e in log
    ]

"""A turn that fails after its send landed keeps its slot's place while that turn
still runs server-side: the next waiter does not start a turn next to it.

``CoderAgent(leave_landed_runs=True)`` — what every durable turn uses — does not
interrupt a run whose submission landed when only the answer was lost (a transport
error, a 5xx): the run is left live for the retry's recovery to follow. The turn then
fails. ``turn_slot``'s exit used to *release* the slot, and the next waiter took it at
once, next to the run going on in chatd (2 running turns at cap 1). Now a failed
turn *abandons* its slot (it lapses at once, unreleased), and a lapsed slot is taken
only once its workflow's chats are at rest (``slot_takeover``).

Real parts: the emulator's fault API loses the response of the step's
``POST …/messages`` (the message lands, the connection closes with no answer); two
in-process fan-outs on one store (SQLite) and the session's Prefect test server; the
count of running turns is the emulator's event log.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from slot_env import left_and_other_after_a_lost_response
from support.prefect_blocks import save_settings

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials


async def test_a_turn_left_running_after_a_lost_response_keeps_its_slot(
    prefect_server: Path,
    emu: Emulator,
    creds: CoderCredentials,
    tmp_path: Path,
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    tenant = f"release-{uuid.uuid4().hex[:8]}"
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 60.0, "turn_slot_ttl": 2.0}
    )
    # keep_chat: b is sent on the chat of `left`'s first step (POST …/messages, the
    # request whose response the emulator loses).
    settings = await save_settings("release", capped, store_url, tenant=tenant, keep_chat=True)
    left_out, other_out, _ = await left_and_other_after_a_lost_response(
        emu, settings, store_url, tenant, b_runs_s=6.0
    )

    # The case under test happened: b's answer was lost and its turn failed
    # transiently (retries 0), leaving its run live for recovery to follow.
    assert [o.ok for o in left_out] == [False], left_out
    assert [o.ok for o in other_out] == [True], other_out
    # The cap counts turns running on the server: `other`'s turn must not start while
    # b's run goes on there.
    log = emu.event_log(["turn_start", "turn_end"])
    assert emu.max_concurrent_turns() == 1, [
        (e["kind"], e["chat_id"], round(e["mono"], 2)) for e in log
    ]

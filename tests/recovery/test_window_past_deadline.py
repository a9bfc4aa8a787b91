"""A repeated effect past the turn deadline, through the real path: ``agent_workflow``
on the Prefect test server, the emulator over its sockets, the payments service, the
state store on SQLite and on PostgreSQL.

The step ``pay`` charges the card, then the model keeps generating past the step's
turn deadline: ``generate()`` hits the deadline, the agent journals the attempt
``cut-short`` and interrupts it, the flow run fails and Prefect retries it. The
retry's recovery resubmits the step (the seed design accepts that), and the
resubmitted attempt's model calls ``charge_card`` again with the SAME arguments under
a NEW tool call id — a new ledger key. The ledger matches it to the call the earlier
attempt applied and answers it with that call's recorded output: the card is charged
once. Without the match the payments service counts two charges (two keys).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from crash_matrix import charge_calls, crash_settings, directive, user_texts
from payments import Payments
from pydantic import SecretStr
from recovery_env import TOKEN

from coder_chat.emulator import Emulator, Script
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker

#: The step's turn deadline: the first attempt's model sleeps far past it.
TURN_S = 3.0


@pytest.fixture(scope="module")
def deadline_emu() -> Iterator[Emulator]:
    """This file's own emulator: the test scripts the resubmitted turn on it."""
    with Emulator.running_in_thread(
        tokens=[TOKEN], delta_delay=0.0, requires_action_timeout=3600.0
    ) as emu:
        yield emu


@pytest.fixture(params=["sqlite", "postgresql"])
async def deadline_settings(
    request: pytest.FixtureRequest,
    prefect_harness: Any,
    deadline_emu: Emulator,
    payments: Payments,
    tmp_path: Path,
) -> AsyncIterator[WorkflowSettings]:
    tag = uuid.uuid4().hex[:8]
    await CoderCredentials(
        base_url=deadline_emu.base_url,
        organization_id=uuid.UUID(deadline_emu.organization_id),
        token=SecretStr(TOKEN),
        request_timeout=10.0,
        turn_timeout=20.0,
    ).save(f"window-deadline-coder-{tag}", overwrite=True)
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    else:
        url = str(request.getfixturevalue("postgres_url"))
    await ChatStateStore(url=url, tenant=f"deadline-{tag}").save(
        f"window-deadline-store-{tag}", overwrite=True
    )
    # The workflow's final archive forgets the chat's ledger: keep the chat, so the
    # test can read what the ledger recorded.
    yield crash_settings(
        f"window-deadline-coder-{tag}",
        f"window-deadline-store-{tag}",
        keep_chat=True,
        turn_timeout_s=TURN_S,
        tool_modules=["payment_tools"],
    )


async def _script_the_resubmission(
    emu: Emulator, payments: Payments, tenant: str, script: Script
) -> str:
    """Once the first attempt's charge applied (its turn chose its script long before),
    script the chat's NEXT turn — the resubmission — and return the chat id."""
    while True:
        with payments.lock:
            keys = [k for k in payments.effects if k.startswith(f"{tenant}/")]
        if keys:
            chat_id = keys[0].split("/")[1]
            emu.script_next_turn(chat_id, script)
            return chat_id
        await asyncio.sleep(0.02)


async def test_a_resubmitted_attempt_repeating_an_applied_call_does_not_charge_again(
    deadline_settings: WorkflowSettings, deadline_emu: Emulator, payments: Payments
) -> None:
    from prefect_coder.blocks import ChatStateStore as Block
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    emu, settings = deadline_emu, deadline_settings
    workflow_id = f"w-deadline-{uuid.uuid4().hex[:8]}"
    charge = {"name": "charge_card", "args": {"amount_cents": 250}}
    steps = [
        Step(name="plan", prompt="Plan." + directive({"text": "A plan."})),
        Step(
            name="pay",
            prompt="Charge the rest."
            + directive(
                {
                    "steps": [
                        {"text": "Charging.", "tool_calls": [charge]},
                        # The model keeps going far past the step's turn deadline.
                        {"sleep": 60, "text": "Too late."},
                    ]
                }
            ),
            tools=["charge_card"],
        ),
    ]
    store = (await Block.aload(settings.store_block)).get_store()
    # The resubmission's model calls the same tool with the same arguments again.
    again = Script.from_json(
        {"steps": [{"text": "Charging again.", "tool_calls": [charge]}, {"text": "All paid."}]}
    )
    scripted = asyncio.create_task(_script_the_resubmission(emu, payments, store.tenant, again))
    try:
        # One flow retry: the run that hit the deadline fails, the retry resubmits pay.
        results = await agent_workflow.with_options(retries=1, retry_delay_seconds=0)(
            workflow_id, steps, settings
        )
        chat_id = await asyncio.wait_for(scripted, 1.0)
    finally:
        scripted.cancel()
    pay = step_marker(workflow_id, "pay")
    history = "\n".join(user_texts(emu, chat_id))
    assert [r.text for r in results] == ["A plan.", "All paid."], history
    # The attempt was cut short and resubmitted: two user turns carry pay's marker,
    # and the model called charge_card twice, under two call ids.
    assert sum(pay in t for t in user_texts(emu, chat_id)) == 2, history
    calls = charge_calls(emu, chat_id)
    assert len(calls) == 2 and len(set(calls)) == 2, calls
    # The card was charged ONCE: one effect, under the first call's key.
    with payments.lock:
        effects = {k: v for k, v in payments.effects.items() if f"/{chat_id}/" in k}
        requests = {k: v for k, v in payments.requests.items() if f"/{chat_id}/" in k}
    assert effects == {f"{store.tenant}/{chat_id}/{calls[0]}": 1}, (effects, requests)
    assert list(requests) == [f"{store.tenant}/{chat_id}/{calls[0]}"], requests
    # The ledger keeps both calls: the resubmitted one answered from the first's record
    # (so a crash of this attempt would still find it done).
    entries = {e.tool_call_id: e for e in await store.ledger.list(chat_id)}
    first, second = entries[calls[0]], entries[calls[1]]
    assert (first.state, first.attempt, first.replay_of) == ("done", 0, None)
    assert (second.state, second.attempt, second.replay_of) == ("done", 1, calls[0])
    assert second.output == first.output == {"charged_cents": 250, "status": "charged"}
    # The step's result shows the resubmitted call answered with the recorded output.
    [call] = [c for c in results[1].tool_calls if c.name == "charge_card"]
    assert call.id == calls[1] and call.output == first.output
    await store.aclose()

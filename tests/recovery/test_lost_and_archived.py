"""Issue 15's recovery gaps, through the real path (emulator, Prefect test server,
SQLite store, a real SIGKILL where a crash is part of the story):

* a finished step whose stored result is lost while the workflow went on (the rerun
  runs where the first run's results are not: another worker's local storage) is
  recovered from the chat's history — whether the journal names a LATER step, or,
  after a second crash, an EARLIER one — and never sent twice;
* a checkpoint that points at an ARCHIVED chat: finished steps come from its history;
  a step whose attempt the archive cut short continues in a fresh chat, which the
  checkpoint then names — never a 400 on every rerun.

Counts come from the emulator (user messages per marker, chats) and the payments
service (effects per idempotency key); no wall-clock assertion.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from crash_matrix import (
    STEPS,
    ForkServer,
    chats_of,
    child_spec,
    crash,
    crash_to_chat,
    env_for_children,
    run_workflow,
    turn_record,
    user_texts,
)
from payments import Payments
from recovery_env import PrefectEnv
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings, step_marker
from prefect_coder.flows.common.resources import load_resources
from prefect_coder.flows.recovery.retire import retire_workflow_chat


def _turns(emu: Emulator, chat_id: str, workflow_id: str, step: str) -> int:
    marker = step_marker(workflow_id, step)
    return sum(marker in t for t in user_texts(emu, chat_id))


def _effects(payments: Payments, chat_id: str) -> dict[str, int]:
    return payments.effects_with_prefix(f"/{chat_id}/")


@pytest.fixture(scope="module")
async def elsewhere(
    prefect_env: PrefectEnv,
    payments: Payments,
    warm_python: WarmPython,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ForkServer]:
    """A fork server whose runs store their Prefect results in a directory of their
    own — another worker's local storage — so a rerun here does not find them (forked
    from the session's warm process: ``ForkServer``'s ``results_dir``)."""
    env = env_for_children(prefect_env.child_env(), payments.url)
    # (PREFECT_* changed since the warm process started: a warm process of its own)
    warm = warm_python if warm_python.would_fork(env) else None
    server = ForkServer(
        env,
        tmp_path_factory.mktemp("elsewhere") / "children-stderr.log",
        warm,
        results_dir=tmp_path_factory.mktemp("elsewhere-results"),
    )
    await server.start()
    yield server
    await server.stop()


async def test_a_finished_step_whose_result_was_lost_is_recovered_not_resent(
    elsewhere: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    spec = child_spec(workflow_id, settings)
    # plan finishes (its result stored where the rerun does not look); pay is
    # SIGKILLed mid-stream and pauses on a call that never ran. The journal names
    # pay: a LATER step than plan, whose result the rerun cannot find.
    chat = await crash_to_chat(
        elsewhere, "turn.mid_stream:2", spec, emu, workflow_id, status="requires_action"
    )
    results = await run_workflow(workflow_id, STEPS, settings)
    assert [r.text for r in results] == baseline
    assert results[0].generate_ms == 0  # plan: rebuilt from history, nothing sent
    # … with what generate() records: the turn's message ids and its usage
    ids, usage = turn_record(emu, chat, results[0].user_message_id)
    assert ids and results[0].message_ids == ids, (results[0].message_ids, ids)
    assert results[0].usage.get("output_tokens") == usage["output_tokens"] > 0, results[0].usage
    assert [_turns(emu, chat, workflow_id, s.name) for s in STEPS] == [1, 1]
    effects = _effects(payments, chat)
    assert sorted(effects.values()) == [1, 1], effects  # one charge per step, once


async def test_a_lost_result_under_a_journal_naming_an_earlier_step_is_not_resent(
    elsewhere: ForkServer,
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    spec = child_spec(workflow_id, settings)
    # 1st crash: pay finished, killed before Prefect persisted its result.
    await crash(elsewhere, "turn.before_persist:2", spec)
    # 2nd crash, on the rerun's own "worker": plan's result is not there either. Its
    # turn journals plan's write-ahead over pay's entry, finds plan finished in
    # history, and is killed before it puts pay's entry back: the journal now names
    # plan — an EARLIER step than pay, whose attempt is the chat's newest turn.
    chat = await crash_to_chat(fork_server, "recovery.before_restore:1", spec, emu, workflow_id)
    resources = await load_resources(settings)
    entry = await resources.store.journal.get(chat)
    assert entry is not None and entry.marker == step_marker(workflow_id, "plan"), entry
    results = await run_workflow(workflow_id, STEPS, settings)
    assert [r.text for r in results] == baseline
    assert [r.generate_ms for r in results] == [0, 0]  # both rebuilt from history
    assert [_turns(emu, chat, workflow_id, s.name) for s in STEPS] == [1, 1]
    assert sorted(_effects(payments, chat).values()) == [1, 1]


async def test_an_archived_chat_with_lost_results_gives_them_back(
    elsewhere: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    # The whole workflow finishes — its chat archived by the final step — but its
    # step results are stored where the rerun does not look (issue 15: 18 of 50
    # reruns then failed with a 400 on the archived chat, every time).
    spec = json.dumps(
        {
            "workflow_id": workflow_id,
            "steps": [s.model_dump(mode="json") for s in STEPS],
            "settings": settings.model_dump(mode="json"),
        }
    )
    assert await elsewhere.run("", spec) == 0, elsewhere.stderr_tail()
    [chat] = chats_of(emu, workflow_id)
    assert emu.chat(chat["id"])["archived"]
    results = await run_workflow(workflow_id, STEPS, settings)
    assert [r.text for r in results] == baseline
    assert [r.generate_ms for r in results] == [0, 0]  # from the archived chat's history
    assert [r.chat_id for r in results] == [chat["id"], chat["id"]]
    assert len(chats_of(emu, workflow_id)) == 1  # no fresh chat was needed
    assert [_turns(emu, chat["id"], workflow_id, s.name) for s in STEPS] == [1, 1]
    assert sorted(_effects(payments, chat["id"]).values()) == [1, 1]


async def _paused_then_archived(
    server: ForkServer, spec: str, emu: Emulator, workflow_id: str, settings: WorkflowSettings
) -> str:
    """pay is SIGKILLed mid-stream (its call never ran); then the operator retires the
    workflow's chat (archive-workflow-chat): the archive stops the paused attempt —
    journaled cut-short first — and archives the chat. Returns the chat's id."""
    old = await crash_to_chat(
        server, "turn.mid_stream:2", spec, emu, workflow_id, status="requires_action"
    )
    archived = await retire_workflow_chat(workflow_id, await load_resources(settings))
    assert archived.archived_chat_ids == [old]
    return old


async def test_a_step_cut_short_by_the_archive_continues_in_a_fresh_chat(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    spec = child_spec(workflow_id, settings)
    old = await _paused_then_archived(fork_server, spec, emu, workflow_id, settings)
    # The rerun: plan's result is stored; pay's attempt on the archived chat was cut
    # short, so pay runs again — in a fresh chat, which becomes the checkpoint.
    results = await run_workflow(workflow_id, STEPS, settings)
    assert [r.text for r in results] == baseline
    chats = {c["id"]: c for c in chats_of(emu, workflow_id)}
    assert len(chats) == 2, chats
    [new] = [c for c in chats if c != old]
    assert results[1].chat_id == new
    assert _turns(emu, old, workflow_id, "pay") == 1  # the cut-short attempt
    assert _turns(emu, new, workflow_id, "pay") == 1  # sent once in the fresh chat
    assert _turns(emu, new, workflow_id, "plan") == 0
    assert emu.chat(new)["archived"] and emu.chat(old)["archived"]  # both retired
    # plan's charge and pay's in the fresh chat; the archived attempt's never ran
    assert sorted(_effects(payments, old).values()) == [1]
    assert sorted(_effects(payments, new).values()) == [1]
    resources = await load_resources(settings)
    checkpoint = await resources.store.checkpoints.get(workflow_id)
    assert checkpoint is not None and checkpoint.chat_id == new


async def test_a_fresh_chat_lost_before_its_checkpoint_is_adopted_not_made_again(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    """As above, but the rerun that creates pay's fresh chat is SIGKILLed right after
    the create response, before the chat is checkpointed: the next rerun finds the
    checkpoint still naming the archived chat, and adopts the fresh chat (which holds
    only pay's prompt) instead of creating a third one."""
    spec = child_spec(workflow_id, settings)
    old = await _paused_then_archived(fork_server, spec, emu, workflow_id, settings)
    # plan's result is stored, so the rerun's first create is pay's fresh chat
    await crash(fork_server, "turn.after_create:1", spec)
    chats = [c["id"] for c in chats_of(emu, workflow_id)]
    assert len(chats) == 2, chats
    [fresh] = [c for c in chats if c != old]

    results = await run_workflow(workflow_id, STEPS, settings)

    assert [r.text for r in results] == baseline
    assert results[1].chat_id == fresh
    assert sorted(c["id"] for c in chats_of(emu, workflow_id)) == sorted([old, fresh])
    assert _turns(emu, fresh, workflow_id, "pay") == 1  # its one send, never repeated
    assert sorted(_effects(payments, fresh).values()) == [1]  # pay's charge, once
    resources = await load_resources(settings)
    checkpoint = await resources.store.checkpoints.get(workflow_id)
    assert checkpoint is not None and checkpoint.chat_id == fresh

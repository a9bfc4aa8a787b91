"""Issue 30, items 2 and 3, through a real 3-step ``agent_workflow`` on the session's
Prefect test server, against the emulator: a fault of the state store never costs the
chat, and no step is ever sent to an archived chat.

(a) PostgreSQL restarted between step 1 and step 2 → the run completes on ONE chat.
(b) PostgreSQL down at step 2's checkpoint for longer than ``transient_retry_s`` →
    step 2 fails retryably, the chat is NOT archived, ``coder.workflow.resumable``
    names it; a rerun after the restart finishes steps 2 and 3 on that chat.
(c) a SIGSTOPped process holds SQLite's write lock during step 2's checkpoint for
    longer than ``connect_timeout`` → the run completes on one chat.
(e) a checkpoint naming an archived chat → the next step runs in a fresh chat, no 400.

Every count comes from the emulator's state and event log: user messages per step
marker, chats, archives. Prefect task retries are off (``retries=0``): what survives
a fault here is the store itself, or a rerun.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults_pg import PrivateCluster
from lock_holder import LockHolder
from prefect.client.orchestration import get_client
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from pydantic import SecretStr

from coder_chat.crash_safe import add_crash_hook
from coder_chat.emulator.server import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.blocks.state.errors import StoreUnavailableError
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.recovery import chat_state

#: SQLite's wait for the write lock per attempt, the store's retry bound, how long a
#: short fault lasts (longer than the lock wait: it failed the step before the fix).
BUSY_S = 0.5
BOUND_S = 3.0
SHORT_FAULT_S = 1.5
#: (b): a bound the outage outlasts.
SHORT_BOUND_S = 0.5


def _steps(*names: str) -> list[Step]:
    return [
        Step(name=n, prompt=f"Say {n}. #emu " + json.dumps([{"text": f"said {n}"}])) for n in names
    ]


async def _settings(emu: Emulator, store: ChatStateStore, suffix: str) -> WorkflowSettings:
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(emu.organization_id),
        token=SecretStr(emu.token),
        request_timeout=15.0,
        turn_timeout=30.0,
    ).save(f"sf-coder-{suffix}", overwrite=True)
    await store.save(f"sf-store-{suffix}", overwrite=True)
    return WorkflowSettings(
        credentials_block=f"sf-coder-{suffix}",
        store_block=f"sf-store-{suffix}",
        retries=0,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=30,  # no lease lapses while the store is down for a few seconds
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=False,
    )


def _workflow_chats(emu: Emulator, workflow_id: str) -> list[dict[str, Any]]:
    return [c for c in emu.chats() if workflow_id in json.dumps(c.get("labels") or {})]


def _user_messages(emu: Emulator, chat_id: str, workflow_id: str, step: str) -> int:
    marker = step_marker(workflow_id, step)
    users = [m for m in emu.messages(chat_id, include_system=False) if m["role"] == "user"]
    return sum(marker in json.dumps(m["content"]) for m in users)


def _archived_before_last_prompt(emu: Emulator, chat_ids: set[str]) -> bool:
    """Was any of the chats archived before the last user message of the workflow?"""
    archived_at = None
    for ev in emu.event_log(["archived", "message"]):
        if ev["chat_id"] not in chat_ids:
            continue
        if ev["kind"] == "archived" and archived_at is None:
            archived_at = ev["mono"]
        elif ev["kind"] == "message" and (ev.get("details") or {}).get("role") == "user":
            if archived_at is not None:
                return True
    return False


def _hook_on(point: str, nth: int, action: Callable[[], None]) -> Callable[[], None]:
    """Run ``action`` the ``nth`` time the crash point ``point`` is reached."""
    seen: list[str] = []

    def hook(name: str) -> None:
        if name == point:
            seen.append(name)
            if len(seen) == nth:
                action()

    return add_crash_hook(hook)


def _assert_one_chat_one_prompt_per_step(emu: Emulator, workflow_id: str, steps: list[str]) -> str:
    [chat] = _workflow_chats(emu, workflow_id)
    for name in steps:
        assert _user_messages(emu, chat["id"], workflow_id, name) == 1, name
    assert not _archived_before_last_prompt(emu, {chat["id"]})
    return str(chat["id"])


async def test_postgresql_restart_between_steps_completes_on_one_chat(
    prefect_harness: Any, chatd_emulator: Emulator, private_pg: PrivateCluster
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    store = ChatStateStore(url=private_pg.url, tenant=f"sf-{suffix}", transient_retry_s=0)
    settings = await _settings(emu, store, suffix)
    workflow_id = f"sf-a-{suffix}"

    def restart() -> None:
        private_pg.stop()
        private_pg.start()  # over before step 2 begins: only pooled connections are dead

    restarted = _hook_on("turn.before_persist", 1, restart)  # step 1 is checkpointed
    try:
        results = await agent_workflow(workflow_id, _steps("one", "two", "three"), settings)
    finally:
        restarted()
    assert [r.text for r in results] == ["said one", "said two", "said three"]  # type: ignore[union-attr]
    chat_id = _assert_one_chat_one_prompt_per_step(emu, workflow_id, ["one", "two", "three"])
    assert emu.chat(chat_id)["archived"]  # by the workflow's final archive


async def test_postgresql_down_at_a_checkpoint_keeps_the_chat_and_a_rerun_finishes(
    prefect_harness: Any, chatd_emulator: Emulator, private_pg: PrivateCluster
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    store = ChatStateStore(
        url=private_pg.url,
        tenant=f"sf-{suffix}",
        connect_timeout=1.0,
        transient_retry_s=SHORT_BOUND_S,
    )
    settings = await _settings(emu, store, suffix)
    workflow_id = f"sf-b-{suffix}"
    steps = _steps("one", "two", "three")
    remove = _hook_on("turn.before_checkpoint", 2, private_pg.stop)  # step 2's checkpoint
    try:
        with pytest.raises(StoreUnavailableError) as failed:
            await agent_workflow(workflow_id, steps, settings)
    finally:
        remove()
        assert not private_pg.running
    assert failed.value.retryable
    [chat] = _workflow_chats(emu, workflow_id)
    assert not emu.chat(chat["id"])["archived"]  # the failure handler left it live
    async with get_client() as client:
        for _ in range(100):
            page = await client.read_events(
                EventFilter(
                    event=EventNameFilter(name=["coder.workflow.resumable"]),
                    resource=EventResourceFilter(id=[f"coder.chat.{chat['id']}"]),
                ),
                limit=10,
            )
            if page.events:
                break
            await asyncio.sleep(0.1)
    [event] = page.events
    assert event.payload["workflow_id"] == workflow_id
    assert event.payload["error"] == "StoreUnavailableError"
    private_pg.start()
    results = await agent_workflow(workflow_id, steps, settings)
    assert [r.text for r in results] == ["said one", "said two", "said three"]  # type: ignore[union-attr]
    assert (
        _assert_one_chat_one_prompt_per_step(emu, workflow_id, ["one", "two", "three"])
        == (chat["id"])
    )


async def test_sqlite_write_lock_held_by_a_stopped_process_during_a_step(
    prefect_harness: Any, chatd_emulator: Emulator, tmp_path: Path
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    path = tmp_path / "state.db"
    store = ChatStateStore(
        url=f"sqlite+aiosqlite:///{path}",
        tenant=f"sf-{suffix}",
        connect_timeout=BUSY_S,
        transient_retry_s=BOUND_S,
    )
    settings = await _settings(emu, store, suffix)
    workflow_id = f"sf-c-{suffix}"
    holders: list[LockHolder] = []

    def lock() -> None:
        holder = LockHolder(path)
        holders.append(holder)
        holder.release_after(SHORT_FAULT_S)

    remove = _hook_on("turn.before_checkpoint", 2, lock)  # during step 2
    try:
        results = await agent_workflow(workflow_id, _steps("one", "two", "three"), settings)
    finally:
        remove()
        for h in holders:
            h.close()
    assert holders and holders[0].releasing_at is not None
    assert [r.text for r in results] == ["said one", "said two", "said three"]  # type: ignore[union-attr]
    _assert_one_chat_one_prompt_per_step(emu, workflow_id, ["one", "two", "three"])


async def test_a_checkpoint_naming_an_archived_chat_is_never_sent_to(
    prefect_harness: Any, chatd_emulator: Emulator, tmp_path: Path
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    store = ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path}/state.db", tenant=f"sf-{suffix}")
    settings = await _settings(emu, store, suffix)
    workflow_id = f"sf-e-{suffix}"
    await agent_workflow(workflow_id, _steps("one", "two"), settings)  # archived at its end
    [first] = _workflow_chats(emu, workflow_id)
    assert emu.chat(first["id"])["archived"]
    # A new process knows nothing of the chat (this one archived it itself).
    chat_state.forget(first["id"])
    results = await agent_workflow(workflow_id, _steps("one", "two", "three"), settings)
    assert [r.text for r in results] == ["said one", "said two", "said three"]  # type: ignore[union-attr]
    chats = {c["id"]: c for c in _workflow_chats(emu, workflow_id)}
    assert len(chats) == 2
    [fresh] = [c for c in chats if c != first["id"]]
    assert _user_messages(emu, first["id"], workflow_id, "three") == 0  # never sent there
    assert _user_messages(emu, fresh, workflow_id, "three") == 1
    assert [_user_messages(emu, first["id"], workflow_id, s) for s in ("one", "two")] == [1, 1]

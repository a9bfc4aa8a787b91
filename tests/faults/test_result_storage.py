"""Issue 30, item 7, with real parts: Prefect's result storage refuses writes for a
while during a 3-step ``agent_workflow`` on the session's Prefect test server,
against the emulator. The directory is made unwritable for real (``tests/faults/
unwritable.py``: ``chmod``, or ``chattr +i`` as root), right after step 2's turn
settled and before its result is written.

Before the fix, Prefect's transaction commit logged the failed write, rolled back,
and left the task ``Completed``: the workflow ended ``Completed`` with step 2's
result missing from storage. Now the step's task writes its result itself before it
returns (``flows/common/result_write.py``) and fails transiently when it cannot:

(a) writable again by the task's retry → the run completes, every result persisted,
    step 2 ran twice as a task but was sent once (the retry recovered it from the
    chat's history), ``coder.result.not-persisted`` names the chat and the step;
(b) unwritable past the retries → the run FAILS (never ``Completed``), the chat is
    kept live with ``coder.workflow.resumable``; a rerun once the storage is back
    recovers step 2 from history, sends step 3, and persists everything.

Counts come from the emulator: one user message per step marker, one chat.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from pydantic import SecretStr
from unwritable import make_unwritable, make_writable

from coder_chat.crash_safe import add_crash_hook
from coder_chat.emulator.server import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.result_write import NOT_PERSISTED_EVENT, ResultNotPersistedError
from prefect_coder.flows.common.results import result_key
from prefect_coder.flows.deployments.agent_workflow import agent_workflow

STEPS = ("one", "two", "three")


def _steps() -> list[Step]:
    return [
        Step(name=n, prompt=f"Say {n}. #emu " + json.dumps([{"text": f"said {n}"}])) for n in STEPS
    ]


async def _settings(emu: Emulator, tmp_path: Path, suffix: str, retries: int) -> WorkflowSettings:
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(emu.organization_id),
        token=SecretStr(emu.token),
        request_timeout=15.0,
        turn_timeout=30.0,
    ).save(f"rs-coder-{suffix}", overwrite=True)
    store = ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path}/state.db", tenant=f"rs-{suffix}")
    await store.save(f"rs-store-{suffix}", overwrite=True)
    return WorkflowSettings(
        credentials_block=f"rs-coder-{suffix}",
        store_block=f"rs-store-{suffix}",
        retries=retries,
        retry_delay_s=0,
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=False,
    )


def _on(point: str, nth: int, action: Callable[[], None]) -> Callable[[], None]:
    """Run ``action`` the ``nth`` time the crash point ``point`` is reached."""
    seen = [0]

    def hook(name: str) -> None:
        if name == point:
            seen[0] += 1
            if seen[0] == nth:
                action()

    return add_crash_hook(hook)


def _stored_text(results: Path, workflow_id: str, step: str) -> str | None:
    path = results / result_key(workflow_id, step)
    if not path.exists():
        return None
    record = json.loads(path.read_text())  # Prefect's record: metadata + the JSON result
    return str(json.loads(record["result"])["data"]["text"])


def _records(results: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in results.iterdir() if p.is_file()]


def _one_chat_one_prompt_per_step(emu: Emulator, workflow_id: str) -> str:
    [chat] = [c for c in emu.chats() if workflow_id in json.dumps(c.get("labels") or {})]
    users = [m for m in emu.messages(chat["id"], include_system=False) if m["role"] == "user"]
    for name in STEPS:
        marker = step_marker(workflow_id, name)
        assert sum(marker in json.dumps(m["content"]) for m in users) == 1, name
    return str(chat["id"])


async def _events(name: str, chat_id: str) -> list[Any]:
    async with get_client() as client:
        for _ in range(100):
            page = await client.read_events(
                EventFilter(
                    event=EventNameFilter(name=[name]),
                    resource=EventResourceFilter(id=[f"coder.chat.{chat_id}"]),
                ),
                limit=10,
            )
            if page.events:
                return list(page.events)
            await asyncio.sleep(0.1)
    return []


async def _task_runs(flow_run_id: Any, workflow_id: str) -> dict[str, Any]:
    """The flow run's step task runs by step, once the server recorded all three
    finished (task-run states reach it through events, in batches)."""
    async with get_client() as client:
        for _ in range(100):
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            by_step = {
                r.name.rsplit("/", 1)[-1]: r
                for r in runs
                if r.name.startswith(workflow_id) and r.state is not None and r.state.is_final()
            }
            if len(by_step) == len(STEPS):
                return by_step
            await asyncio.sleep(0.1)
    return {r.name: r for r in runs}


async def test_result_storage_unwritable_until_the_retry(
    prefect_harness: Any, chatd_emulator: Emulator, tmp_path: Path, results_dir: Path
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    settings = await _settings(emu, tmp_path, suffix, retries=1)
    workflow_id = f"rs-a-{suffix}"
    # Step 2's turn has settled (checkpointed); its result is not written yet.
    broken = _on("turn.before_persist", 2, lambda: make_unwritable(results_dir))
    # Every attempt of a step passes "turn.slot_held": the 3rd is step 2's retry.
    repaired = _on("turn.slot_held", 3, lambda: make_writable(results_dir))
    try:
        state = await agent_workflow(workflow_id, _steps(), settings, return_state=True)
    finally:
        broken()
        repaired()
    assert state.is_completed()
    results = await state.aresult()  # type: ignore[attr-defined]
    assert [r.text for r in results] == ["said one", "said two", "said three"]
    for name in STEPS:  # before the fix: step 2's result was never written
        assert _stored_text(results_dir, workflow_id, name) == f"said {name}", name
    chat_id = _one_chat_one_prompt_per_step(emu, workflow_id)  # recovered, never resent
    assert emu.chat(chat_id)["archived"]
    by_step = await _task_runs(state.state_details.flow_run_id, workflow_id)
    assert by_step["two"].run_count == 2  # a visible retry, not a silent Completed
    assert by_step["one"].run_count == by_step["three"].run_count == 1
    [event] = await _events(NOT_PERSISTED_EVENT, chat_id)
    assert event.payload["step"] == "two"
    assert event.payload["key"] == result_key(workflow_id, "two")


async def test_result_storage_unwritable_past_the_retries(
    prefect_harness: Any, chatd_emulator: Emulator, tmp_path: Path, results_dir: Path
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    settings = await _settings(emu, tmp_path, suffix, retries=0)
    workflow_id = f"rs-b-{suffix}"
    broken = _on("turn.before_persist", 2, lambda: make_unwritable(results_dir))
    try:
        # Before the fix this returned: Completed, step 2's result missing.
        with pytest.raises(ResultNotPersistedError) as failed:
            await agent_workflow(workflow_id, _steps(), settings)
    finally:
        broken()
    assert failed.value.retryable
    assert _stored_text(results_dir, workflow_id, "two") is None
    [chat] = [c for c in emu.chats() if workflow_id in json.dumps(c.get("labels") or {})]
    assert not emu.chat(chat["id"])["archived"]  # kept live for a rerun
    [resumable] = await _events("coder.workflow.resumable", chat["id"])
    assert resumable.payload["error"] == "ResultNotPersistedError"

    make_writable(results_dir)  # the storage is back
    state = await agent_workflow(workflow_id, _steps(), settings, return_state=True)
    results = await state.aresult()  # type: ignore[attr-defined]
    assert [r.text for r in results] == ["said one", "said two", "said three"]
    by_step = await _task_runs(state.state_details.flow_run_id, workflow_id)
    # Step 1's record, written by the task itself, is what Prefect's cache reads back.
    assert by_step["one"].state.name == "Cached"
    assert by_step["two"].state.name == "Completed"  # recovered from history, stored now
    for name in STEPS:
        assert _stored_text(results_dir, workflow_id, name) == f"said {name}", name
    assert _one_chat_one_prompt_per_step(emu, workflow_id) == chat["id"]
    assert emu.chat(chat["id"])["archived"]


async def test_the_record_written_early_is_the_one_prefect_reads_back(
    prefect_harness: Any, tmp_path: Path, results_dir: Path
) -> None:
    """The early write stands in for the commit's under any cache policy: a
    SERIALIZABLE one (the key locked by the transaction: written as its holder) and a
    cache expiration (carried on the record); the next run of the task reads it
    ``Cached`` and does not run the body again."""
    from datetime import timedelta

    from prefect import flow, task
    from prefect.cache_policies import INPUTS
    from prefect.locking.filesystem import FileSystemLockManager

    from prefect_coder.flows.common.result_write import write_step_result

    calls: list[int] = []
    policy = INPUTS.configure(
        isolation_level="SERIALIZABLE",
        lock_manager=FileSystemLockManager(lock_files_directory=tmp_path / "locks"),
    )

    @task(
        persist_result=True,
        result_serializer="json",
        cache_policy=policy,
        cache_expiration=timedelta(hours=1),
    )
    async def step(x: int) -> dict[str, int]:
        calls.append(x)
        return await write_step_result({"x": x}, workflow_id="wf", step="s")

    @flow
    async def run(x: int) -> Any:
        return await step(x, return_state=True)

    first, again = await run(7), await run(7)
    assert (first.name, again.name) == ("Completed", "Cached")
    assert calls == [7]
    [record] = _records(results_dir)
    assert json.loads(record["result"]) == {"x": 7}
    assert record["metadata"]["expiration"] is not None

"""Transient network failures are retried through recovery, not archived away.

A reset ``POST /messages`` (the emulator's "landed, response lost") and a stalled
response that runs into the httpx read timeout (``http_timeout``, distinct from
the turn's deadline) fail the turn with ``CoderTransportError`` /
``CoderTimeoutError``. The turn task retries them; the retry's
recover-before-send decides from the journal and the chat's history whether the
send landed. The workflow finishes on the same chat and archives it once, at the
end. Real Prefect test server, real emulator faults, real SQLite store.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from flow_helpers import TOKEN, say, user_messages

from coder_chat.emulator import Emulator
from coder_chat.errors import CoderTimeoutError, CoderTransportError
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.retry import is_retryable_failure
from prefect_coder.flows.deployments.agent_workflow import agent_workflow


@pytest.fixture(autouse=True)
def _product_commit_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests time a late commit against the product's commit horizon (the
    per-segment request timeout). tests/recovery shortens the horizon for the rest of
    its pytest session (PREFECT_CODER_COMMIT_HORIZON_S=1.0); under xdist a worker can
    run these files after it, and a 1 s horizon against a 1 s late commit races."""
    monkeypatch.delenv("PREFECT_CODER_COMMIT_HORIZON_S", raising=False)


@pytest.fixture(scope="module")
async def short_http_block(prefect_env: object, emu: Emulator) -> str:
    """Credentials whose single REST calls time out fast (0.5 s) while turns may
    take 30 s: a stalled response is an httpx timeout, not the turn deadline."""
    name = f"flows-test-coder-http-{uuid.uuid4().hex[:6]}"
    creds = CoderCredentials.model_validate(
        {
            "base_url": emu.base_url,
            "organization_id": emu.organization_id,
            "token": TOKEN,
            "request_timeout": 15.0,
            "turn_timeout": 30.0,
            "http_timeout": 0.5,
        }
    )
    await creds.save(name, overwrite=True)
    return name


def _steps() -> list[Step]:
    return [
        Step(name="one", prompt="First." + say("one done")),
        Step(name="two", prompt="Second." + say("two done")),
        Step(name="three", prompt="Third." + say("three done")),
    ]


def _markers(emu: Emulator, chat_id: str) -> list[str]:
    return [m.split(" ", 1)[0] for m in user_messages(emu, chat_id)]


def test_transport_failures_are_retryable_but_the_turn_deadline_is_not() -> None:
    reset = CoderTransportError(
        "POST", "http://x/api/v2/chats/c/messages", "ReadError", retry_safe=False
    )
    stalled = CoderTimeoutError(
        "POST", "http://x/api/v2/chats/c/messages", "ReadTimeout", retry_safe=False
    )
    assert is_retryable_failure(reset)
    assert is_retryable_failure(stalled)
    assert isinstance(stalled, TimeoutError)
    # generate(timeout=turn_timeout) expiring: the same prompt meets the same deadline.
    assert not is_retryable_failure(TimeoutError("turn timeout"))


async def _run(emu: Emulator, settings: WorkflowSettings, workflow_id: str) -> list[Any]:
    try:
        return await agent_workflow(workflow_id, _steps(), settings)
    finally:
        emu.faults.clear()


def _archived(emu: Emulator, chat_id: str) -> int:
    return len([e for e in emu.event_log(["archived"]) if e["chat_id"] == chat_id])


async def test_reset_post_messages_is_recovered_and_archived_once(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    settings = settings.model_copy(update={"retries": 2})
    # Step one creates the chat (POST /chats); the next message POST is step two's.
    emu.faults.drop_response(1, method="POST", path="/messages")
    results = await _run(emu, settings, workflow_id)

    assert [r.text for r in results] == ["one done", "two done", "three done"]
    chat_id = results[0].chat_id
    assert {r.chat_id for r in results} == {chat_id}
    assert any(e["details"].get("fault") == "drop_response" for e in emu.event_log(["fault"]))
    one, two, three = (step_marker(workflow_id, s) for s in ("one", "two", "three"))
    # The lost response's message landed: the SDK's teardown interrupt may have cut
    # it short, so recovery after this known failure resubmits at most once (the
    # documented at-least-once window of a send); never a third time, never blind.
    assert _markers(emu, chat_id) in ([one, two, three], [one, two, two, three])
    assert _archived(emu, chat_id) == 1
    assert emu.chat(chat_id)["archived"] is True


async def test_a_stall_is_an_http_timeout_and_a_final_transient_failure_keeps_the_chat(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    short_http_block: str,
    store: StateStore,
) -> None:
    # No retries: the run fails with the transient error itself.
    settings = settings.model_copy(update={"retries": 0, "credentials_block": short_http_block})
    emu.faults.delay_commit(1.5, count=1, method="POST", path="/messages")
    # The 0.5 s http_timeout ends the stalled call as an HTTP timeout
    # (CoderTimeoutError), not as the 30 s turn deadline (a builtin TimeoutError).
    with pytest.raises(CoderTimeoutError):
        await _run(emu, settings, workflow_id)
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None
    chat_id = cp.chat_id
    # The failure handler left the chat live: a rerun can continue it.
    assert _archived(emu, chat_id) == 0 and emu.chat(chat_id)["archived"] is False

    await asyncio.sleep(1.5)  # let the stalled POST commit late, as a slow server would
    results = await _run(emu, settings, workflow_id)
    assert [r.text for r in results] == ["one done", "two done", "three done"]
    assert {r.chat_id for r in results} == {chat_id}
    one, two, three = (step_marker(workflow_id, s) for s in ("one", "two", "three"))
    # The late message is in history: recovery read it before sending again.
    assert _markers(emu, chat_id) in ([one, two, three], [one, two, two, three])
    assert _archived(emu, chat_id) == 1


async def test_a_stalled_send_is_retried_by_the_task_within_the_run(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str, short_http_block: str
) -> None:
    # Prefect files a raised TimeoutError as "TimedOut" but still asks the retry
    # condition: the httpx timeout is retried, through recovery. The stalled POST
    # commits (0.8 s) before the retry starts (1.5 s): the retry's recovery finds
    # the landed message in history and never sends blindly. (A retry that starts
    # while the stalled send is still in flight at the server is the documented
    # at-least-once window of a send.)
    settings = settings.model_copy(
        update={"retries": 1, "retry_delay_s": 1.5, "credentials_block": short_http_block}
    )
    emu.faults.delay_commit(0.8, count=1, method="POST", path="/messages")
    results = await _run(emu, settings, workflow_id)
    assert [r.text for r in results] == ["one done", "two done", "three done"]
    chat_id = results[0].chat_id
    one, two, three = (step_marker(workflow_id, s) for s in ("one", "two", "three"))
    assert _markers(emu, chat_id) in ([one, two, three], [one, two, two, three])
    assert _archived(emu, chat_id) == 1


async def test_a_send_still_in_flight_when_the_retry_starts_is_not_sent_twice(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    """The retry starts at once, while the timed-out POST is still on its way to a
    commit: the kept write-ahead makes recovery wait out the send's commit window
    (the per-segment request_timeout, 3 s here) and find the late message, so the
    step is sent exactly once."""
    name = f"flows-test-coder-inflight-{uuid.uuid4().hex[:6]}"
    await CoderCredentials.model_validate(
        {
            "base_url": emu.base_url,
            "organization_id": emu.organization_id,
            "token": TOKEN,
            "request_timeout": 3.0,
            "turn_timeout": 30.0,
            "http_timeout": 0.5,
        }
    ).save(name, overwrite=True)
    settings = settings.model_copy(
        update={"retries": 1, "retry_delay_s": 0, "credentials_block": name}
    )
    emu.faults.delay_commit(1.0, count=1, method="POST", path="/messages")
    results = await _run(emu, settings, workflow_id)
    assert [r.text for r in results] == ["one done", "two done", "three done"]
    chat_id = results[0].chat_id
    one, two, three = (step_marker(workflow_id, s) for s in ("one", "two", "three"))
    assert _markers(emu, chat_id) == [one, two, three]
    assert _archived(emu, chat_id) == 1

"""Model-only steps inside ``agent_workflow`` on a real Prefect test server: mixed
with agent turns, persisted (a re-run calls nothing), 429 retried by Prefect, 401
not, and the token in no result, log or stored file."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from model_env import TOKEN

from coder_chat.emulator import Emulator
from coder_chat.gateway import GatewayAuthError
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import ModelStep, Step, WorkflowSettings
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.turn.approval_step import ApprovalResult
from prefect_coder.flows.turn.model_step import ModelStepResult


async def _settings(emu: Emulator, tmp_path: Path, **creds: object) -> WorkflowSettings:
    name = uuid.uuid4().hex[:10]
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=emu.organization_id,
        token=TOKEN,
        request_timeout=15.0,
        turn_timeout=30.0,
        **creds,  # type: ignore[arg-type]
    ).save(f"model-coder-{name}", overwrite=True)
    await ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path / 'state.db'}").save(
        f"model-store-{name}", overwrite=True
    )
    return WorkflowSettings(
        credentials_block=f"model-coder-{name}",
        store_block=f"model-store-{name}",
        retries=1,
        retry_delay_s=0,
        lease_ttl_s=10,
        settle_wait_s=2,
        redial_backoff_ms=20,
        artifacts=False,
    )


def _scan(root: Path) -> tuple[str, str]:
    """Every stored file's text, and every file name, under the result storage."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return "".join(p.read_text(errors="replace") for p in files), " ".join(p.name for p in files)


def _aibridge(emu: Emulator) -> list[dict]:
    return [e["details"] for e in emu.event_log(["aibridge"])]


async def test_mixed_workflow_persists_and_reruns_for_free(
    prefect_server: Path, emu: Emulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = await _settings(emu, tmp_path)
    wf = f"mix-{uuid.uuid4().hex[:8]}"
    steps = [
        ModelStep(
            name="plan",
            model="gpt-x",
            prompt="Plan a fix for the flaky test",
            output_model="fix_plan",
        ),
        Step(name="work", prompt="Apply the plan"),
        ModelStep(
            name="summary",
            api="anthropic",
            model="claude-x",
            prompt="Summarize: {previous}",
        ),
    ]
    with caplog.at_level(logging.DEBUG):
        first = await agent_workflow(wf, steps, settings)
    plan, work, summary = first
    assert isinstance(plan, ModelStepResult) and plan.structured is not None
    assert plan.structured["summary"].startswith("summary: Plan a fix")
    assert isinstance(work, TurnResult) and work.text.startswith("Echo: ")
    assert isinstance(summary, ModelStepResult) and summary.api == "anthropic"
    # {previous} carried the agent turn's answer into the model step.
    assert summary.text.startswith("Echo: Summarize: Echo: ")
    calls = _aibridge(emu)
    assert [(c["api"], c["model"]) for c in calls] == [
        ("openai", "gpt-x"),
        ("anthropic", "claude-x"),
    ]
    assert len(emu.event_log(["turn_start"])) == 1
    # No chat for the model steps: exactly one chat, archived at the end.
    assert [c["archived"] for c in emu.chats()] == [True]

    again = await agent_workflow(wf, steps, settings)
    assert [r.model_dump() for r in again] == [r.model_dump() for r in first]
    assert len(_aibridge(emu)) == 2  # nothing called again
    assert len(emu.event_log(["turn_start"])) == 1

    stored, names = _scan(prefect_server)
    assert "coder-model-" in names
    for text in (stored, caplog.text, str(first)):
        assert TOKEN not in text


async def test_rate_limit_is_retried_and_auth_failure_is_not(
    prefect_server: Path, emu: Emulator, tmp_path: Path
) -> None:
    settings = await _settings(emu, tmp_path)
    step = ModelStep(name="classify", model="m", prompt="classify this", output_model="fix_plan")
    emu.faults.fail_rest(1, status=429, method="POST", path="/aibridge/")
    [result] = await agent_workflow(f"rl-{uuid.uuid4().hex[:8]}", [step], settings)
    assert isinstance(result, ModelStepResult) and result.attempts == 1
    assert len(emu.event_log(["fault"])) == 1 and len(_aibridge(emu)) == 1

    emu.faults.fail_rest(5, status=401, method="POST", path="/aibridge/")
    with pytest.raises(GatewayAuthError):
        await agent_workflow(f"auth-{uuid.uuid4().hex[:8]}", [step], settings)
    assert len(emu.event_log(["fault"])) == 2  # one try: 401 is not retried
    emu.faults.clear()


async def test_invalid_twice_fails_the_step_without_retry(
    prefect_server: Path, emu: Emulator, tmp_path: Path
) -> None:
    settings = await _settings(emu, tmp_path)
    step = ModelStep(
        name="x",
        model="m",
        output_model="fix_plan",
        prompt='extract #gw {"invalid": 9}',
    )
    with pytest.raises(Exception, match="did not match FixPlan after one re-ask"):
        await agent_workflow(f"inv-{uuid.uuid4().hex[:8]}", [step], settings)
    assert len(_aibridge(emu)) == 2


async def test_byok_mode_from_the_block(
    prefect_server: Path, emu: Emulator, tmp_path: Path
) -> None:
    settings = await _settings(emu, tmp_path, ai_gateway_upstream_key="sk-up-XYZ")
    step = ModelStep(name="s", model="m", prompt="hello")
    [result] = await agent_workflow(f"byok-{uuid.uuid4().hex[:8]}", [step], settings)
    assert result.text == "Echo: hello"
    assert _aibridge(emu)[0]["byok"] is True
    assert not isinstance(result, ApprovalResult)

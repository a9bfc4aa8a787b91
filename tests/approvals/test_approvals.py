"""Approval steps on a real Prefect test server: the flow run suspends (its process
exits), a person resumes it with typed input, and a fresh process continues from
the persisted results. Flow runs are executed the way a process worker does it:
``python -m prefect.engine`` with ``PREFECT__FLOW_RUN_ID``."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import yaml
from approval_env import TOKEN
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.events import DeploymentEventTrigger
from prefect.flow_runs import aresume_flow_run
from prefect.settings import PREFECT_API_URL
from prefect.states import Failed
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.expire_approvals import EXPIRED_MESSAGE, expire_approvals
from prefect_coder.flows.turn.approval_earlier import asked_tag

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
async def deployment_id(prefect_server: Path) -> UUID:
    deployment = await agent_workflow.to_deployment(name="approvals-test")
    return await deployment.apply()


async def _start(
    deployment_id: UUID, emu: Emulator, tmp_path: Path, steps: list[dict[str, Any]], **opts: Any
) -> tuple[UUID, str]:
    name = uuid.uuid4().hex[:10]
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=emu.organization_id,
        token=TOKEN,
        request_timeout=15.0,
        turn_timeout=30.0,
    ).save(f"appr-coder-{name}", overwrite=True)
    await ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path / 'state.db'}").save(
        f"appr-store-{name}", overwrite=True
    )
    settings = {
        "credentials_block": f"appr-coder-{name}",
        "store_block": f"appr-store-{name}",
        "retries": 0,
        "lease_ttl_s": 10,
        "artifacts": False,
        **opts,
    }
    wf = f"appr-{name}"
    async with get_client() as client:
        run = await client.create_flow_run_from_deployment(
            deployment_id, parameters={"workflow_id": wf, "steps": steps, "settings": settings}
        )
    return run.id, wf


#: ``python -m prefect.engine`` with Prefect's loggers at a level other than the
#: session's WARNING: the loggers that ``PREFECT_LOGGING_LEVEL`` sets in Prefect's
#: logging.yml, set at run time (a changed ``PREFECT_LOGGING_LEVEL`` would make the
#: warm process start a fresh interpreter that imports Prefect again: ~5 CPU-s).
_ENGINE_AT_LEVEL = """
import logging, runpy, sys
for name in ("prefect", "prefect.extra", "prefect.client", "prefect.infrastructure"):
    logging.getLogger(name).setLevel({level!r})
sys.modules.pop("prefect.engine", None)
runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
"""


def _execute(warm: WarmPython, run_id: UUID, results: Path, log_level: str = "WARNING") -> str:
    """Run the flow run in a fresh process, like a process worker (blocks until it exits);
    returns what the process printed on stderr. The process is forked from the
    session's warm process (tests/warm_python.py: no second import of Prefect)."""
    env = dict(
        os.environ,
        PREFECT__FLOW_RUN_ID=str(run_id),
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(results),
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY="",
        PYTHONPATH=str(ROOT),
    )
    env.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
    argv = ["-m", "prefect.engine"]
    if log_level != "WARNING":
        argv = ["-c", _ENGINE_AT_LEVEL.format(level=log_level)]
    proc = warm.run(argv, env=env, cwd=ROOT, timeout=90)
    assert TOKEN not in proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


async def _run(run_id: UUID) -> FlowRun:
    async with get_client() as client:
        return await client.read_flow_run(run_id)


STEPS: list[dict[str, Any]] = [
    {"name": "draft", "prompt": "Draft the change"},
    {"name": "review", "kind": "approval", "prompt": "Ship the draft?", "timeout_s": 600},
    {"name": "apply", "prompt": "Apply the draft"},
]


def _as_dict(result: Any) -> dict[str, Any]:
    return result if isinstance(result, dict) else result.model_dump()


def _user_texts(emu: Emulator) -> list[str]:
    out = []
    for chat in emu.chats():
        for m in emu.messages(chat["id"], include_system=False):
            if m["role"] == "user":
                out.append("".join(p.get("text", "") for p in m["content"]))
    return out


async def _suspend(
    warm: WarmPython,
    deployment_id: UUID,
    emu: Emulator,
    tmp_path: Path,
    prefect_server: Path,
    steps: list[dict],
    log_level: str = "WARNING",
) -> tuple[UUID, str]:
    run_id, wf = await _start(deployment_id, emu, tmp_path, steps)
    stderr = await asyncio.to_thread(_execute, warm, run_id, prefect_server, log_level)
    await _assert_suspended(run_id, stderr, emu)
    return run_id, wf


async def _assert_suspended(run_id: UUID, stderr: str, emu: Emulator) -> None:
    """The engine process exited with the run suspended, waiting for a person."""
    # Waiting for a person is not an error: Prefect's "Finished in state Suspended"
    # line (ERROR in its engine) is lowered to INFO.
    exit_lines = [line for line in stderr.splitlines() if "Finished in state Suspended" in line]
    assert exit_lines and not [line for line in exit_lines if "ERROR" in line], stderr[-2000:]
    run = await _run(run_id)
    assert run.state is not None
    assert run.state.type == StateType.PAUSED and run.state.name == "Suspended"
    # The chat sits idle in `waiting` (never requires_action) while nobody decides.
    [chat] = emu.chats()
    assert chat["status"] == "waiting" and not chat["archived"]
    assert run.state.state_details.run_input_keyset is not None  # the UI's typed form
    # Tagged as asking, so a later run of the workflow finds the answer given to this
    # one if this one ends before it records it (flows/turn/approval_earlier.py).
    workflow_id = str(run.parameters["workflow_id"])
    assert asked_tag(workflow_id) in run.tags, run.tags


#: Three approvals in one workflow, one per way a person lets it go on: each resume is
#: one engine process that runs to the next approval (4 processes for the three
#: decisions; one suspended run per decision took 6, each ~1 CPU-s with its share of
#: the test server's work).
DECIDED_STEPS: list[dict[str, Any]] = [
    *STEPS,
    {"name": "review-docs", "kind": "approval", "prompt": "Docs too?", "timeout_s": 600},
    {"name": "docs", "prompt": "Write the docs"},
    {"name": "review-tests", "kind": "approval", "prompt": "Tests too?", "timeout_s": 600},
    {"name": "tests", "prompt": "Write the tests"},
]


async def test_approve_edit_and_a_prompt_changed_under_approve_continue_from_persisted_results(
    prefect_server: Path,
    deployment_id: UUID,
    emu: Emulator,
    tmp_path: Path,
    warm_python: WarmPython,
) -> None:
    """Each decision resumes the run in a fresh process that continues from the
    persisted results (no earlier turn sent again): **approve** sends the next step
    as written; **edit** replaces the next prompt; what a person typed is never
    dropped — the form comes filled with the next prompt, and a change there under
    **approve** is sent and recorded as an edit."""
    run_id, wf = await _suspend(
        warm_python, deployment_id, emu, tmp_path, prefect_server, DECIDED_STEPS
    )
    decisions: list[dict[str, Any]] = [
        {"decision": "approve", "comment": "lgtm"},
        {"decision": "edit", "next_prompt": "Write the docs, briefly"},
        {"decision": "approve", "next_prompt": "Write the tests, carefully"},
    ]
    for i, decision in enumerate(decisions):
        await aresume_flow_run(run_id, run_input=decision)
        stderr = await asyncio.to_thread(_execute, warm_python, run_id, prefect_server)
        if i < len(decisions) - 1:
            await _assert_suspended(run_id, stderr, emu)  # at the next approval
    run = await _run(run_id)
    assert run.state is not None and run.state.type == StateType.COMPLETED
    results = await run.state.aresult()
    assert [r["step"] if isinstance(r, dict) else r.step for r in results] == [
        s["name"] for s in DECIDED_STEPS
    ]
    texts = _user_texts(emu)
    # No turn was sent again after a resume; each next prompt as decided.
    assert len(texts) == 4, texts
    assert "Draft the change" in texts[0] and "Apply the draft" in texts[1]
    assert "Write the docs, briefly" in texts[2]
    assert "Write the tests, carefully" in texts[3]
    assert len(emu.event_log(["turn_start"])) == 4
    assert [c["archived"] for c in emu.chats()] == [True]
    review, docs, tests = (_as_dict(results[i]) for i in (1, 3, 5))
    assert (review["decision"], review["comment"]) == ("approve", "lgtm")
    assert (docs["decision"], docs["next_prompt"]) == ("edit", "Write the docs, briefly")
    assert (tests["decision"], tests["next_prompt"]) == ("edit", "Write the tests, carefully")
    # A later run of the same workflow finds every step, the decisions included,
    # stored: it neither suspends (it has no deployment: it could not) nor sends.
    rerun = await agent_workflow(wf, DECIDED_STEPS, WorkflowSettings(**run.parameters["settings"]))
    assert [_as_dict(r) for r in rerun] == [_as_dict(r) for r in results]
    assert len(emu.event_log(["turn_start"])) == 4


async def test_suspending_says_where_to_decide_and_a_reject_archives_the_chat_and_stops(
    prefect_server: Path,
    deployment_id: UUID,
    emu: Emulator,
    tmp_path: Path,
    warm_python: WarmPython,
) -> None:
    """One suspended run for both (each needs a run suspended by a real engine
    process; the logs are read before the decision): suspending logs where to decide
    and no error, and a reject then archives the chat and stops."""
    run_id, _ = await _suspend(
        warm_python, deployment_id, emu, tmp_path, prefect_server, STEPS, log_level="INFO"
    )
    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
        )
    assert logs, "the run shipped no logs"
    waiting = [entry for entry in logs if "waits for a decision" in entry.message]
    assert waiting and waiting[0].level == logging.INFO
    assert f"/flow-run/{run_id}" in waiting[0].message  # where to decide
    suspended = [entry for entry in logs if "Finished in state Suspended" in entry.message]
    assert suspended and all(entry.level == logging.INFO for entry in suspended)
    assert not [entry for entry in logs if entry.level >= logging.ERROR]

    await aresume_flow_run(run_id, run_input={"decision": "reject", "comment": "no"})
    await asyncio.to_thread(_execute, warm_python, run_id, prefect_server)
    run = await _run(run_id)
    assert run.state is not None and run.state.type == StateType.COMPLETED
    results = await run.state.aresult()
    assert (
        results[-1]["decision"] == "reject"
        if isinstance(results[-1], dict)
        else (results[-1].decision == "reject")
    )
    assert len(emu.event_log(["turn_start"])) == 1  # "apply" never ran
    assert [c["archived"] for c in emu.chats()] == [True]


async def test_timeout_follows_the_failure_handler(
    prefect_server: Path,
    deployment_id: UUID,
    emu: Emulator,
    tmp_path: Path,
    warm_python: WarmPython,
) -> None:
    steps = [dict(s) for s in STEPS]
    steps[1]["timeout_s"] = 1
    run_id, _ = await _suspend(warm_python, deployment_id, emu, tmp_path, prefect_server, steps)
    await asyncio.sleep(1.2)
    handled = await expire_approvals()
    assert str(run_id) in handled
    run = await _run(run_id)
    assert run.state is not None and run.state.type == StateType.FAILED
    assert run.state.message == EXPIRED_MESSAGE
    assert [c["archived"] for c in emu.chats()] == [True]
    # Idempotent: a second sweep does nothing.
    assert str(run_id) not in await expire_approvals()


async def test_only_an_expired_approval_triggers_expire_approvals(prefect_server: Path) -> None:
    """The prefect.yaml trigger of ``expire-approvals`` fires for the failure an
    expired approval produces and for no other failed ``agent-workflow`` run, and a
    collision queues the run instead of dropping it."""
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    [expire] = [d for d in spec["deployments"] if d["name"] == "expire-approvals"]
    assert expire["concurrency_limit"]["collision_strategy"] == "ENQUEUE"
    name = f"expire-approvals-{uuid.uuid4().hex[:6]}"
    expire_id = await (
        await expire_approvals.to_deployment(
            name=name, triggers=[DeploymentEventTrigger(**t) for t in expire["triggers"]]
        )
    ).apply()
    workflow_id = await (await agent_workflow.to_deployment(name="agent-workflow")).apply()
    params = {"workflow_id": "wf-expiry", "steps": [{"name": "a", "prompt": "p"}]}
    async with get_client() as client:

        async def fail_a_run(message: str) -> None:
            run = await client.create_flow_run_from_deployment(workflow_id, parameters=params)
            await client.set_flow_run_state(run.id, Failed(message=message), force=True)

        async def triggered() -> list[FlowRun]:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[expire_id]))
            )

        await fail_a_run("Flow run encountered an exception: boom")
        await fail_a_run(EXPIRED_MESSAGE)
        deadline = asyncio.get_running_loop().time() + 90
        while not await triggered():
            assert asyncio.get_running_loop().time() < deadline, "the trigger never fired"
            await asyncio.sleep(0.5)
        # The triggers service reads events in order: the earlier, unrelated failure was
        # evaluated first. Give a late action a moment to show before counting.
        await asyncio.sleep(2)
        count = len(await triggered())
        # The session's server is shared: other tests serve deployments of these names.
        for dep_id in (expire_id, workflow_id):
            await client.delete_resource_owned_automations(f"prefect.deployment.{dep_id}")
            await client.delete_deployment(dep_id)
    assert count == 1

"""Every client tool of a durable workflow is crash-safe by default.

A plain ``@registered_tool`` (tests/flows/effect_tools.py) runs behind the
write-ahead ledger without any crash-safe decorator. A real SIGKILL of the
flow-run process right after the tool's effect (before ``done``) leaves a
``committing`` entry; the rerun's recovery re-drives the tool with the SAME
idempotency key, submits its output and recovers the revived run's answer. So
the effect is applied exactly once, the prompt is sent once, the chat is
archived once. A tool declared ``pure=True`` skips the ledger.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from effect_tools import effect_rows
from flow_helpers import ROOT, emu_directive, user_messages

from coder_chat.crash_safe import CrashSafeTool, PureTool
from coder_chat.emulator import Emulator
from coder_chat.tools import ToolContext
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.toolset import bind_crash_safe
from prefect_coder.flows.deployments.agent_workflow import agent_workflow

HERE = Path(__file__).resolve().parent
TOOL_MODULES = ["prefect_coder.flows.demo_tools", "effect_tools"]


def _child(warm: Any, prefect_env: Any, spec: dict[str, Any], crash_at: str, db: Path) -> int:
    # The flow-run process that SIGKILLs itself: a process of its own, forked from
    # the session's warm process (no second import of Prefect).
    env = prefect_env.subprocess_env(
        CRASH_AT=crash_at, CRASH_SPEC=json.dumps(spec), EFFECT_DB=str(db)
    )
    env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"
    proc = warm.run([str(HERE / "tool_crash_child.py")], env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return int(proc.returncode)


async def test_plain_tool_killed_after_its_effect_applies_it_once(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    store: StateStore,
    prefect_env: Any,
    warm_python: Any,
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    db = tmp_path / "effects.db"
    monkeypatch.setenv("EFFECT_DB", str(db))  # this process's tool writes the same file
    settings = settings.model_copy(update={"tool_modules": TOOL_MODULES, "lease_ttl_s": 1.0})
    script = [
        {"tool_calls": [{"name": "bump_counter", "args": {"amount": 7}}]},
        {"text": "bumped by 7"},
    ]
    steps = [
        Step(name="bump", prompt="Bump it." + emu_directive(script), tools=["bump_counter"]),
        Step(name="after", prompt="Then this." + emu_directive({"text": "after done"})),
    ]
    spec = {
        "workflow_id": workflow_id,
        "steps": [s.model_dump(mode="json") for s in steps],
        "settings": settings.model_dump(mode="json"),
    }
    await asyncio.to_thread(_child, warm_python, prefect_env, spec, "tool.after_effect", db)

    calls, effects = effect_rows(str(db))
    assert len(calls) == 1 and len(effects) == 1  # the effect ran, then the process died
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None  # the chat was made durable before the effect
    chat_id = cp.chat_id
    assert emu.chat(chat_id)["status"] == "requires_action"
    [(key, _pid)] = calls
    entry = await store.ledger.get(chat_id, key.rsplit("/", 1)[-1])
    assert entry is not None and entry.state == "committing"
    assert key == store.ledger.idempotency_key(chat_id, key.rsplit("/", 1)[-1])

    # The rerun (a new flow run of the same workflow id) recovers the step.
    results = await agent_workflow(workflow_id, steps, settings)

    assert [r.text for r in results] == ["bumped by 7", "after done"]  # type: ignore[union-attr]
    calls, effects = effect_rows(str(db))
    # Re-driven once with the same key; the external system applied it once.
    assert len(calls) == 2 and {k for k, _ in calls} == {key}
    assert effects == [(key, 7)]
    # One user message per step: the crashed attempt was recovered, not resubmitted.
    markers = [m.split(" ", 1)[0] for m in user_messages(emu, chat_id)]
    assert markers == [step_marker(workflow_id, "bump"), step_marker(workflow_id, "after")]
    archived = [e for e in emu.event_log(["archived"]) if e["chat_id"] == chat_id]
    assert len(archived) == 1


async def test_registered_tools_are_ledgered_unless_declared_pure(
    store: StateStore, tmp_path: Path, monkeypatch: Any
) -> None:
    db = tmp_path / "effects.db"
    monkeypatch.setenv("EFFECT_DB", str(db))
    registry.load_tool_modules(TOOL_MODULES)
    plain, lookup = registry.get_tool("bump_counter"), registry.get_tool("lookup_build")
    assert not isinstance(plain, CrashSafeTool) and isinstance(lookup, PureTool)
    bound_plain, bound_lookup = bind_crash_safe([plain, lookup], store.ledger)
    assert isinstance(bound_plain, CrashSafeTool) and bound_plain.ledger is store.ledger
    assert bound_lookup is lookup  # pure=True: no ledger, recovery re-runs it

    # Live: write-ahead, the tool sees the ledger key, "done" with its output after.
    chat_id, call_id = f"chat-{uuid.uuid4().hex[:8]}", "call-1"
    ctx = ToolContext(tool_call_id=call_id, chat_id=chat_id, tool_name="bump_counter")
    outcome = await bound_plain.run({"amount": 3}, ctx)
    assert not outcome.is_error and outcome.output == {"bumped": 3}
    calls, effects = effect_rows(str(db))
    key = store.ledger.idempotency_key(chat_id, call_id)
    assert calls[-1][0] == key and (key, 3) in effects
    entry = await store.ledger.get(chat_id, call_id)
    assert entry is not None and entry.state == "done" and entry.output == {"bumped": 3}

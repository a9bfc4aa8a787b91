"""Tool modules are one worker-wide setting shared by every deployment.

A fresh process (a stand-in for a worker's flow-run process) knows the user's
tools without any ``settings.tool_modules``: one module comes from
``PREFECT_CODER_TOOL_MODULES``, another from the ``prefect_coder.tools``
entry-point group of an installed package (a real ``.dist-info`` on the path,
found by ``importlib.metadata``). The workflow runs steps with both tools, and a
module that cannot be imported is a parameter error naming its source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flow_helpers import emu_directive, run_child, user_messages

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings, step_marker

HERE = Path(__file__).resolve().parent

SHARED_MODULE = """
from pydantic import BaseModel
from coder_chat.tools import ToolContext
from prefect_coder.tools import registered_tool


class Shout(BaseModel):
    text: str


@registered_tool(name="shout", description="Upper-case a text.", pure=True)
async def shout(args: Shout, ctx: ToolContext) -> str:
    return args.text.upper()
"""

CHILD = """
import asyncio, json, os
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import Step, WorkflowSettings

spec = json.loads(os.environ["SPEC"])
steps = [Step.model_validate(s) for s in spec["steps"]]
settings = WorkflowSettings.model_validate(spec["settings"])
results = asyncio.run(agent_workflow(spec["workflow_id"], steps, settings))
out = {
    "texts": [r.text for r in results],
    "chat_id": results[0].chat_id,
    "calls": [[c.name, c.output] for r in results for c in r.tool_calls],
    "sources": registry.shared_tool_sources(),
}
os.environ["PREFECT_CODER_TOOL_MODULES"] = "effect_tools, no_such_tools_mod_q"
try:
    registry.load_tool_modules([])
except WorkflowParameterError as exc:
    out["error"] = [exc.field, str(exc)]
print("RESULT " + json.dumps(out))
"""


def _install_fake_package(root: Path) -> None:
    """A package installed the ordinary way leaves a .dist-info with entry_points.txt."""
    (root / "shared_tools_ep.py").write_text(SHARED_MODULE)
    dist = root / "shared_tools_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shared-tools-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[prefect_coder.tools]\nshared = shared_tools_ep\n")


def test_tools_from_the_env_var_and_entry_points_need_no_settings(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    prefect_env: Any,
    warm_python: Any,
    tmp_path: Path,
) -> None:
    _install_fake_package(tmp_path)
    bump = [{"tool_calls": [{"name": "bump_counter", "args": {"amount": 2}}]}, {"text": "bumped"}]
    loud = [{"tool_calls": [{"name": "shout", "args": {"text": "hi"}}]}, {"text": "shouted"}]
    spec = {
        "workflow_id": workflow_id,
        "steps": [
            {"name": "bump", "prompt": "Bump." + emu_directive(bump), "tools": ["bump_counter"]},
            {"name": "loud", "prompt": "Shout." + emu_directive(loud), "tools": ["shout"]},
        ],
        # The run names no tool module at all: the worker's shared setting supplies them.
        "settings": settings.model_copy(update={"tool_modules": []}).model_dump(mode="json"),
    }
    proc = run_child(
        warm_python,
        prefect_env,
        CHILD,
        SPEC=json.dumps(spec),
        EFFECT_DB=str(tmp_path / "effects.db"),
        PREFECT_CODER_TOOL_MODULES="effect_tools",
        PYTHONPATH=os.pathsep.join(
            [str(tmp_path), str(HERE), prefect_env.subprocess_env()["PYTHONPATH"]]
        ),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])

    assert out["texts"] == ["bumped", "shouted"]
    assert out["calls"] == [["bump_counter", {"bumped": 2}], ["shout", "HI"]]
    assert out["sources"] == ["effect_tools", "entry point shared = shared_tools_ep"]
    markers = [m.split(" ", 1)[0] for m in user_messages(emu, out["chat_id"])]
    assert markers == [step_marker(workflow_id, "bump"), step_marker(workflow_id, "loud")]
    field, message = out["error"]
    assert field == "PREFECT_CODER_TOOL_MODULES"
    assert "no_such_tools_mod_q" in message and "Fix: " in message

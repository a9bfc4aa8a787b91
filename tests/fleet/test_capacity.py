"""The emulator's capacity like the real server's (5 root chats by default from the
CLI; extra chats stay ``running`` with ``queued_for_capacity: true``), and workflows
that meet it without a cap of their own still finish."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import httpx
from fleet_env import TOKEN
from test_fleet import _settings, _step

from coder_chat.emulator import Emulator
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout


def test_cli_defaults_to_the_real_servers_capacity() -> None:
    for extra, expected in (([], 5), (["--max-concurrent-root-chats", "0"], None)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "coder_chat.emulator.cli", "--admin-token", "adm", *extra],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip().split("=", 1)[1]
            info = httpx.get(
                f"{url}/__emulator__/info", headers={"X-Emulator-Admin-Token": "adm"}
            ).json()
            assert info["config"]["max_concurrent_root_chats"] == expected
        finally:
            proc.terminate()
            proc.wait(10)


async def test_workflows_queue_behind_server_capacity(prefect_server: Path, tmp_path: Path) -> None:
    with Emulator.running_in_thread(
        tokens=[TOKEN], delta_delay=0.0, max_concurrent_root_chats=5
    ) as emu:
        # No cap of ours: the server's capacity queue is what bounds the turns.
        settings = await _settings(emu, f"sqlite+aiosqlite:///{tmp_path / 's.db'}", cap=None)
        run = uuid.uuid4().hex[:6]
        items = [
            FanoutItem(workflow_id=f"cap-{run}-{i}", steps=[_step("s", 0.2)]) for i in range(8)
        ]
        outcomes = await agent_fanout(items, settings)
        assert all(o.ok for o in outcomes)
        assert emu.max_concurrent_turns() <= 5
        assert len(emu.event_log(["turn_start"])) == 8

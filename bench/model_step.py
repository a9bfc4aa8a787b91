"""Overhead of ``model_step`` over a raw ``httpx`` POST to the same AI Gateway surface.

Both send the same structured-output request (OpenAI surface, ``response_format``
``json_schema``) to the local emulator, ``--n`` times each:

* raw — one ``httpx.AsyncClient`` POSTing the body and parsing the JSON;
* client — ``GatewayClient.structured`` (body building, pydantic validation);
* task — the ``model_step`` Prefect task inside a flow (a task run with a
  persisted JSON result per call; fresh workflow ids, so nothing is cached).

Reports median and p95 per call and the overhead ratio against raw.

Run: ``.venv/bin/python bench/model_step.py [--n 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect import flow  # noqa: E402
from prefect.settings import (  # noqa: E402
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_LOGGING_LEVEL,
    PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    temporary_settings,
)
from prefect.testing.utilities import prefect_test_harness  # noqa: E402
from prefect.utilities.annotations import quote  # noqa: E402

from coder_chat.emulator import Emulator  # noqa: E402
from coder_chat.gateway import GatewayClient  # noqa: E402
from prefect_coder.blocks import CoderCredentials, StateStore  # noqa: E402
from prefect_coder.flows.common.params import ModelStep, WorkflowSettings  # noqa: E402
from prefect_coder.flows.common.resources import TurnResources  # noqa: E402
from prefect_coder.flows.demo_tools import FixPlan  # noqa: E402
from prefect_coder.flows.turn.model_step import model_step  # noqa: E402

TOKEN = f"bench-{uuid.uuid4().hex}"


def _stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1000, s[int(0.95 * (len(s) - 1))] * 1000


async def _raw(emu: Emulator, n: int) -> list[float]:
    body = {
        "model": "m",
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": "Plan a fix"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "FixPlan", "schema": FixPlan.model_json_schema()},
        },
    }
    out = []
    async with httpx.AsyncClient() as http:
        for _ in range(n):
            t0 = time.perf_counter()
            r = await http.post(
                f"{emu.base_url}/api/v2/aibridge/openai/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            r.raise_for_status()
            r.json()
            out.append(time.perf_counter() - t0)
    return out


async def _client(emu: Emulator, n: int) -> list[float]:
    out = []
    async with GatewayClient(emu.base_url, TOKEN) as gw:
        for _ in range(n):
            t0 = time.perf_counter()
            await gw.structured("openai", "m", "Plan a fix", FixPlan)
            out.append(time.perf_counter() - t0)
    return out


@flow(persist_result=False)
async def _task_flow(n: int, creds: Any, store: Any) -> list[float]:
    # As agent_workflow runs it: one shared client (pool), inputs quoted.
    client = creds.get_client()
    resources = quote(TurnResources(creds, store, client=client))
    settings = WorkflowSettings(artifacts=False)
    step = ModelStep(name="plan", model="m", prompt="Plan a fix", output_model="fix_plan")
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await model_step(f"bench-{uuid.uuid4().hex[:8]}-{i}", step, settings, resources)
        out.append(time.perf_counter() - t0)
    await client.aclose()
    return out


async def _main(n: int, tmp: Path) -> None:
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as emu:
        creds = CoderCredentials(
            base_url=emu.base_url, organization_id=emu.organization_id, token=TOKEN
        )
        store = StateStore(f"sqlite+aiosqlite:///{tmp / 's.db'}")
        await _raw(emu, 20)  # warm-up
        raw = await _raw(emu, n)
        client = await _client(emu, n)
        task = await _task_flow(n, creds, store)
    r50, r95 = _stats(raw)
    for label, samples in (("raw httpx", raw), ("GatewayClient", client), ("model_step", task)):
        m, p = _stats(samples)
        print(
            f"{label:>14}: median {m:6.2f} ms  p95 {p:6.2f} ms  "
            f"ratio {m / r50:5.2f}x (median)  {p / r95:5.2f}x (p95)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-model-"))
    with temporary_settings(
        updates={
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp / "results",
            PREFECT_LOGGING_LEVEL: "ERROR",
        }
    ):
        with prefect_test_harness(server_startup_timeout=60):
            asyncio.run(_main(args.n, tmp))


if __name__ == "__main__":
    main()

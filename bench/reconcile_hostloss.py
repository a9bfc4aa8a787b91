"""Host loss → recovered result with ``reconcile-workflows`` running, on the deployed path.

``bench/recovery.py --deployed`` (``bench/recovery_deployed.py``) measures kill →
recovered result as a user deploys the product: ``prefect deploy --all``, the zombie
automation with 30 s heartbeats, process workers. This runs its host-loss episodes
(the worker running the workflow SIGKILLed with its children, after the run's first
heartbeat) with the reconciler ticking as ``prefect.yaml`` ships it — one looping
``reconcile-workflows`` run — on a worker of its own (``--limit 1``), so a lost host
never takes the reconciler with it. Per kill it adds who marked the run Crashed: the
reconciler (its lease stopped renewing while Prefect showed it Running) or the zombie
automation (heartbeats).

    PREFECT_CODER_TEST_PG_BIN=/usr/lib/postgresql/15/bin nice -n 10 \\
        .venv/bin/python bench/reconcile_hostloss.py --host-losses 5 --kills 0 --tick-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import recovery_deployed as rd  # noqa: E402
from deployed_env import deployed_env, snapshot_head  # noqa: E402


async def _reconciler(env: Any, client: Any, tick_s: float, options: str | None) -> Any:
    """Start the looping reconciler on a worker of its own; its flow run once Running."""
    from prefect.deployments import run_deployment

    await env.start_worker("reconciler", "--limit", "1")
    run = await run_deployment(  # type: ignore[misc]
        "reconcile-workflows/reconcile-workflows",
        parameters={
            "run_for_s": 7200,
            "tick_s": tick_s,
            **({"options": json.loads(options)} if options else {}),
        },
        timeout=0,
        client=client,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        current = await client.read_flow_run(run.id)
        if current.state is not None and current.state.is_running():
            return current
        if current.state is not None and current.state.is_final():
            raise RuntimeError(
                f"the reconciler ended {current.state.name}: {current.state.message}"
            )
        await asyncio.sleep(1)
    raise TimeoutError("the reconciler never ran")


async def run(args: argparse.Namespace) -> None:
    from payments import running_payments

    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="bench-reconcile-hostloss-"))
    os.chmod(tmp, 0o755)
    print(f"load at start: {os.getloadavg()}; work dir {tmp}", flush=True)
    source = tmp / "src"
    print(f"flow runs run HEAD {snapshot_head(source)[:10]}", flush=True)
    with running_payments() as payments:
        worker_env = {
            "PYTHONPATH": str(source / "tests" / "recovery"),
            "PREFECT_CODER_TOOL_MODULES": "payment_tools",
            "PAYMENTS_URL": payments.url,
        }
        if args.worker_query_s is not None:
            worker_env["PREFECT_WORKER_QUERY_SECONDS"] = str(args.worker_query_s)
        async with deployed_env(
            tmp, worker_env=worker_env, emulator_args=("--delta-delay", "0"), source=source
        ) as env:
            with env.prefect():
                from prefect.client.orchestration import get_client

                async with get_client() as client:
                    reconciler = await _reconciler(env, client, args.tick_s, args.options)
                    print(f"reconciler running: {reconciler.id}", flush=True)
                    for i in range(args.workers):
                        await env.start_worker(f"w{i + 1}")
                    bench = rd.Bench(env, args, payments)
                    ff = await bench.fault_free(client)
                    print(f"fault-free workflow: {ff:.1f} s", flush=True)
                    kills: list[Any] = []
                    loads: list[float] = []
                    by: dict[str, str] = {}
                    for i in range(args.host_losses):
                        # After the first heartbeat (the run's start), spread over the run.
                        offset = ff * (0.1 + 0.5 * i / max(1, args.host_losses - 1))
                        k = rd.Kill("host", f"bh-{i}-{os.urandom(3).hex()}", offset)
                        try:
                            k = await bench.episode(client, k)
                        except Exception as exc:
                            k.skipped = f"error: {exc!r}"[:300]
                        kills.append(k)
                        loads.append(os.getloadavg()[0])
                        if k.run_id:
                            state = (await client.read_flow_run(k.run_id)).state
                            message = (state.message or "") if state else ""
                            by[k.workflow_id] = (
                                "reconciler"
                                if "reconcile-workflows" in message
                                else "zombie"
                                if "zombie" in message
                                else message[:40] or "?"
                            )
                        ph = k.phases()
                        print(
                            f"  host loss {i}: total {rd._fmt(ph['total'])} s, detection "
                            f"{rd._fmt(ph['detection'])} s, crashed by {by.get(k.workflow_id)}"
                            + (f" [{k.skipped}]" if k.skipped else ""),
                            flush=True,
                        )
                    await bench.account(kills)
                    rd.report(kills, args, ff)
    done = [k for k in kills if not k.skipped and k.phases()["total"] is not None]
    totals = sorted(float(k.phases()["total"]) for k in done)
    if totals:
        print(
            f"\nhost loss -> recovered result: n={len(totals)}, median "
            f"{statistics.median(totals):.1f} s, p95 {rd.pct(totals, 0.95):.1f} s, max "
            f"{totals[-1]:.1f} s; crashed by: {sorted(by.values())}"
        )
    print(f"load (1 min) during: {loads}; at end {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rd.add_arguments(parser)
    parser.add_argument("--tick-s", type=float, default=30.0, help="the reconciler's tick")
    parser.add_argument("--continuation", type=float, default=5.0)
    parser.add_argument(
        "--options", default=None, help="the reconciler's options as JSON (default: prefect.yaml's)"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

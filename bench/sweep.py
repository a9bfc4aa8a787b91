"""Benchmark of the orphan sweep: 10,000 labelled chats, 1 % of them orphans.

    .venv/bin/python bench/sweep.py [--chats 10000] [--orphans 0.01] [--concurrency 16]
                                     [--page-size 500] [--pg URL]

Sets up the chatd emulator (in this process, its own thread) with ``--chats`` chats
carrying this collection's labels, and a real SQLite state store (a temp file; or
PostgreSQL with ``--pg``) that checkpoints all but ``--orphans`` of them. Then runs
the orphan sweep itself (``prefect_coder.flows.sweeps.run.run_orphan_sweep``: list every page of
both archived states, read the store, decide, retire each orphan with bounded
concurrency — interrupt, archive, forget) and prints chats/s and the total time.
Then runs it again (nothing left to retire) to show the steady-state cost of a
scheduled run. Everything shares one Python process, i.e. one core for the sweep
and the emulator together (pin it with ``taskset -c 0`` to be sure). Prefect's
flow-run overhead (≈ 0.1 s against a local server) is not included; events are
off (no Prefect API here). Target: under 60 s for 10,000 chats.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.labels import chat_labels
from prefect_coder.flows.sweeps.options import SweepOptions
from prefect_coder.flows.sweeps.run import run_orphan_sweep

TENANT = "bench"


async def _create(client: ChatClient, org: str, n: int, concurrency: int) -> list[str]:
    ids: list[str] = [""] * n
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            chat = await client.create_chat(
                CreateChatRequest(
                    organization_id=org,
                    content=[ChatInputPart.text_part(f"[wf-{i}/s] hi #emu " + '{"text": "ok"}')],
                    labels=chat_labels(TENANT, f"wf-{i}", "00000000-0000-4000-8000-0000000000be"),
                )
            )
            ids[i] = chat.id

    await asyncio.gather(*(one(i) for i in range(n)))
    return ids


async def main(args: argparse.Namespace) -> None:
    n, n_orphans = args.chats, max(1, round(args.chats * args.orphans))
    with tempfile.TemporaryDirectory() as tmp:
        url = args.pg or f"sqlite+aiosqlite:///{Path(tmp) / 'state.db'}"
        store = StateStore(url, tenant=TENANT)
        with Emulator.running_in_thread(delta_delay=0.0, log_requests=False) as emu:
            async with ChatClient(
                emu.base_url, emu.token, organization_id=emu.organization_id, timeout=60
            ) as client:
                t0 = time.perf_counter()
                ids = await _create(client, emu.organization_id, n, 64)
                orphans = set(ids[:: max(1, n // n_orphans)][:n_orphans])
                async with store.transaction() as tx:
                    for i, chat_id in enumerate(ids):
                        if chat_id not in orphans:
                            await tx.checkpoints.set(f"wf-{i}", chat_id, None)
                # let every first turn settle (an orphan may be retired in any status)
                for _ in range(6000):
                    if all(c["status"] == "waiting" for c in emu.chats()):
                        break
                    await asyncio.sleep(0.1)
                setup = time.perf_counter() - t0
                print(
                    f"setup: {n} chats ({len(orphans)} orphans) in {setup:.1f}s ({url.split(':')[0]})"
                )

                opts = SweepOptions(
                    concurrency=args.concurrency,
                    page_size=args.page_size,
                    archive_retry_s=0.05,
                    emit_events=False,
                )
                for label in ("sweep", "steady"):
                    t1 = time.perf_counter()
                    report = await run_orphan_sweep(client, store, grace_s=0, options=opts)
                    total = time.perf_counter() - t1
                    print(
                        f"{label}: {report.listed} chats listed in {report.list_s:.2f}s, "
                        f"{report.counts} in {total:.2f}s total → {report.listed / total:,.0f} "
                        f"chats/s; failed {report.failed}"
                    )
                    if label == "sweep":
                        retired = {r.chat_id for r in report.rows if r.decision == "retire"}
                        assert retired == orphans, (len(retired), len(orphans))
                        assert report.failed == 0
                archived = sum(1 for c in emu.chats() if c["archived"])
                assert archived == len(orphans), archived
                print(f"check: exactly the {archived} orphans are archived, no checkpointed chat")
        await store.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=10_000)
    parser.add_argument("--orphans", type=float, default=0.01, help="fraction of orphans")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=500)
    parser.add_argument("--pg", default=None, help="PostgreSQL URL instead of SQLite")
    asyncio.run(main(parser.parse_args()))

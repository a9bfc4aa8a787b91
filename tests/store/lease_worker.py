"""A separate OS process contending for leases (driven by test_lease_processes.py).

Started once and reused (importing Prefect costs ≈ 1 s per process): it prints
``READY``, then runs one JSON command per stdin line:

* ``{"op": "contend", "url", "tenant", "key_once", "key_cm", "hold"}`` — waits for a
  ``go`` line, then one raw acquire of ``key_once`` (exactly one process may win) and a
  waited, held lease on ``key_cm``; prints one JSON result line.
* ``{"op": "hold", "url", "tenant", "key", "ttl"}`` — takes the lease, prints
  ``HELD <fence> <holder>``, then, holding and renewing it like a running step, sets
  checkpoint ``wf`` to (``chat-i``, ``i``) for i = 1, 2, ... and prints ``i`` after
  each commit, until the process is killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


def _import_store_without_prefect() -> None:
    # The store does not need Prefect; importing the `prefect_coder` / `prefect_coder.blocks`
    # packages would (their __init__ imports the Prefect blocks: ≈ 4 s of CPU per process,
    # > 30 s for five processes on a loaded 2-core machine). Register bare package objects
    # so that only `prefect_coder.blocks.state` is imported: the code the blocks use.
    import types
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name, path in (
        ("prefect_coder", root / "prefect_coder"),
        ("prefect_coder.blocks", root / "blocks"),
    ):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg


_import_store_without_prefect()

from prefect_coder.blocks.state import StateStore, default_holder  # noqa: E402


async def _line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def contend(cmd: dict[str, Any]) -> None:
    store = StateStore(cmd["url"], tenant=cmd["tenant"])
    holder = default_holder()
    await store.ensure_schema()
    print("ARMED", flush=True)
    await _line()  # "go": released together with the other processes
    won = await store.leases.acquire(cmd["key_once"], holder, ttl=30) is not None
    async with store.lease(cmd["key_cm"], holder=holder, ttl=5, wait=20, poll_interval=0.01) as h:
        enter = time.time()
        await asyncio.sleep(cmd["hold"])
        leave = time.time()
        fence = h.fence
    await store.aclose()
    result = {"holder": holder, "won": won, "enter": enter, "leave": leave, "fence": fence}
    print(json.dumps(result), flush=True)


async def hold(cmd: dict[str, Any]) -> None:
    store = StateStore(cmd["url"], tenant=cmd["tenant"])
    ttl = float(cmd["ttl"])
    async with store.lease(cmd["key"], ttl=ttl, wait=5, renew_interval=ttl / 4) as held:
        print(f"HELD {held.fence} {held.holder}", flush=True)
        i = 0
        while True:  # until SIGKILL
            i += 1
            await store.checkpoints.set("wf", f"chat-{i}", i)
            print(i, flush=True)  # acknowledged only after the commit returned
            await asyncio.sleep(0.005)


async def main() -> None:
    print("READY", flush=True)
    while line := await _line():
        cmd = json.loads(line)
        await {"contend": contend, "hold": hold}[cmd["op"]](cmd)


if __name__ == "__main__":
    asyncio.run(main())

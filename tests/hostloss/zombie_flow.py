"""The flow a lost host was running: it only waits (its process is killed)."""

from __future__ import annotations

import asyncio

from prefect import flow

FLOW_NAME = "hostloss-zombie"


@flow(name=FLOW_NAME)
async def sleeper() -> None:
    """Sleeps until killed; the engine around it emits heartbeats."""
    print("STARTED", flush=True)
    await asyncio.sleep(3600)

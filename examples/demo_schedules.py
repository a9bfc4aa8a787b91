"""Lighter schedules for the demo's own Prefect server (run by ``scripts/demo`` after
``prefect deploy --all``).

``prefect.yaml`` schedules what production needs: ``sweep-stuck-turns`` every
minute, ``expire-approvals`` every 5 minutes, ``sweep-orphans`` every 15. On the
demo's laptop server (SQLite) those runs, each a new flow-run process, were enough
load to make the server answer "503 database is locked" to the UI's "Create run"
and "Resume" now and then. The demo keeps every deployment and schedule (so the
UI shows what production runs) and only stretches the intervals; the reconciler,
which guarantees that every workflow finishes, keeps its own schedule.
"""

from __future__ import annotations

import asyncio

from prefect import get_client
from prefect.client.schemas.schedules import CronSchedule

#: deployment name -> the demo's cron (production's is in prefect.yaml).
DEMO_CRON = {
    "sweep-stuck-turns": "*/10 * * * *",
    "expire-approvals": "*/10 * * * *",
    "sweep-orphans": "0 * * * *",
}


async def main() -> None:
    async with get_client() as client:
        for name, cron in DEMO_CRON.items():
            deployment = await client.read_deployment_by_name(f"{name}/{name}")
            for schedule in await client.read_deployment_schedules(deployment.id):
                await client.update_deployment_schedule(
                    deployment.id, schedule.id, schedule=CronSchedule(cron=cron)
                )
            print(f"    {name}: {cron} (the demo's; prefect.yaml keeps production's)")


if __name__ == "__main__":
    asyncio.run(main())

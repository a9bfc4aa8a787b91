"""Save the demo's blocks on the Prefect server named by PREFECT_API_URL.

Reads the emulator's CODER_URL / CODER_SESSION_TOKEN / CODER_ORG_ID from the
environment (scripts/demo exports them) and saves:

* ``coder`` — a CoderCredentials block pointing at the emulator (overwritten on
  every run, so a restarted emulator's new port and token take effect);
* the ChatStateStore block type (the demo uses the default local SQLite store,
  so no document is needed; the type is registered to show up in the UI).
"""

from __future__ import annotations

import asyncio
import os

from prefect_coder.blocks import ChatStateStore, CoderCredentials


async def main() -> None:
    creds = CoderCredentials(
        base_url=os.environ["CODER_URL"],
        organization_id=os.environ.get("CODER_ORG_ID"),
        token=os.environ["CODER_SESSION_TOKEN"],
    )
    await creds.save("coder", overwrite=True)
    await ChatStateStore.register_type_and_schema()
    print(f"    saved block coder-credentials/coder → {creds.base_url}")


if __name__ == "__main__":
    asyncio.run(main())

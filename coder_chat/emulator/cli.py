"""``coder-chat-emulator``: run the emulator as a program.

Prints ``CODER_URL=…`` as the first stdout line once it accepts connections, then
``CODER_ORG_ID=…``, ``CODER_SESSION_TOKEN=…`` (only when no ``--token`` was given) and
``CODER_EMULATOR_ADMIN_TOKEN=…``. Stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from .server import Emulator


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coder-chat-emulator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0 = any free port)")
    p.add_argument(
        "--token",
        action="append",
        default=[],
        help="accepted session token; repeat for more users (each its own user)",
    )
    p.add_argument("--admin-token", default=None, help="control API token (default random)")
    p.add_argument("--organization-id", default=None, help="organization UUID (default random)")
    p.add_argument("--requires-action-timeout", type=float, default=300.0)
    p.add_argument("--ping-interval", type=float, default=15.0)
    p.add_argument("--delta-delay", type=float, default=0.005)
    p.add_argument("--delta-count", type=int, default=5)
    p.add_argument(
        "--max-concurrent-root-chats",
        type=int,
        default=5,
        help="capacity like the real server's default (5); extra running chats wait with "
        "queued_for_capacity: true. 0 = unlimited",
    )
    return p


async def _amain(args: argparse.Namespace) -> None:
    emu = Emulator(
        args.token or None,
        host=args.host,
        port=args.port,
        admin_token=args.admin_token,
        organization_id=args.organization_id,
        requires_action_timeout=args.requires_action_timeout,
        ping_interval=args.ping_interval,
        delta_delay=args.delta_delay,
        delta_count=args.delta_count,
        max_concurrent_root_chats=args.max_concurrent_root_chats or None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with emu:
        out = sys.stdout
        out.write(f"CODER_URL={emu.base_url}\n")
        out.write(f"CODER_ORG_ID={emu.organization_id}\n")
        if not args.token:
            out.write(f"CODER_SESSION_TOKEN={emu.token}\n")
        out.write(f"CODER_EMULATOR_ADMIN_TOKEN={emu.admin_token}\n")
        out.flush()
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_amain(args))
    except KeyboardInterrupt:  # pragma: no cover - signal handler normally wins
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""coder-chat-emulator: run the chatd emulator as a program.

Once it accepts connections it prints, flushing stdout:

  CODER_URL=http://HOST:PORT        (always the first line)
  CODER_ORG_ID=<uuid>
  CODER_SESSION_TOKEN=<token>       (only when no --token was given)
  CODER_EMULATOR_ADMIN_TOKEN=<token>

and serves until SIGINT or SIGTERM, then closes every connection and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from .eras import DEFAULT_ERA, ERA_ENV, ERA_NAMES, NEWEST
from .server import Emulator

_EPILOG = """\
eras (server builds, oldest first):
  b1  core routes on /api/experimental/chats and /api/v2/chats; /stream takes only
      after_id; no status: search key; status events without history_version
  b2  adds the after_revision stream cursor, history_version on status events,
      q=status:... and archived:any
  b3  core routes on /api/v2/chats only; the stream cursor is history_version;
      POST /chats accepts empty content (chat starts waiting); interrupting a chat
      no worker holds goes straight to waiting; PATCH validates before writing;
      GET messages adds turn_start_id and history_version

The control API (/__emulator__/..., header X-Emulator-Admin-Token) scripts turns
and injects faults; see docs/emulator.md.
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line parser (its ``--help`` documents every option and the eras)."""
    p = argparse.ArgumentParser(
        prog="coder-chat-emulator",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=0, help="port to listen on (default: 0, any free port)"
    )
    p.add_argument(
        "--era",
        choices=ERA_NAMES,
        default=None,
        help=f"server build to play, see below (default: ${ERA_ENV} if set, else "
        f"{DEFAULT_ERA}; {NEWEST} is the newest)",
    )
    p.add_argument(
        "--token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="a session token to accept; repeat for more users, each token is its own "
        "user (default: one random token, printed as CODER_SESSION_TOKEN)",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        metavar="TOKEN",
        help="token for the control API (default: random, printed as CODER_EMULATOR_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--organization-id",
        default=None,
        metavar="UUID",
        help="the organization's UUID (default: random, printed as CODER_ORG_ID)",
    )
    p.add_argument(
        "--requires-action-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a chat waits in requires_action for tool results before they "
        "time out and the model continues (default: 300, the server's)",
    )
    p.add_argument(
        "--ping-interval",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="WebSocket ping interval; a missing pong closes the socket with 1001 "
        "(default: 15, the server's)",
    )
    p.add_argument(
        "--delta-delay",
        type=float,
        default=0.005,
        metavar="SECONDS",
        help="pause after each streamed delta of the scripted model (default: 0.005)",
    )
    p.add_argument(
        "--delta-count",
        type=int,
        default=5,
        metavar="N",
        help="deltas per text part of the scripted model's default reply (default: 5)",
    )
    p.add_argument(
        "--max-concurrent-root-chats",
        type=int,
        default=5,
        metavar="N",
        help="capacity, like the server's default of 5: further running chats wait "
        "with queued_for_capacity set; 0 means unlimited (default: 5)",
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
        era=args.era,
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
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(_amain(args))
    except KeyboardInterrupt:  # pragma: no cover - signal handler normally wins
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

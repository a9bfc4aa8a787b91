"""Benchmark the chatd emulator (not a test).

Runs the emulator CLI in a subprocess pinned to one core (when ``taskset`` exists) and
prints:

* events/s delivered on one stream (one long turn of zero-delay text deltas);
* p50/p99 latency of a trivial turn (POST /messages → ``waiting`` status on the chat's
  stream) with 1, 100 and 1,000 concurrent chats, each holding its stream open, all sent
  at once.

Usage: ``python bench/emulator.py [--chats 1,100,1000] [--deltas 20000] [--era b1|b2|b3]``

Requests go to ``/api/v2/chats``, the prefix every server build serves (B3 serves only
that one), as the client does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import websockets

from coder_chat.rest import V2_PREFIX as P


def start_emulator(era: str | None = None) -> tuple[subprocess.Popen[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "coder_chat.emulator.cli", "--delta-delay", "0"]
    if era:
        cmd += ["--era", era]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    env: dict[str, str] = {}
    assert proc.stdout is not None
    while len(env) < 4:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("emulator exited early")
        k, _, v = line.strip().partition("=")
        env[k] = v
    return proc, env


async def set_default(base: str, admin: str, script: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=base) as c:
        r = await c.post(
            "/__emulator__/script/default",
            json={"script": script},
            headers={"X-Emulator-Admin-Token": admin},
        )
        r.raise_for_status()


async def events_per_second(env: dict[str, str], deltas: int) -> float:
    base, tok, org = env["CODER_URL"], env["CODER_SESSION_TOKEN"], env["CODER_ORG_ID"]
    await set_default(
        base,
        env["CODER_EMULATOR_ADMIN_TOKEN"],
        {
            "parts": [
                {"type": "sleep", "seconds": 0.2},
                {"type": "text", "text": "x" * deltas, "deltas": deltas, "delay": 0},
            ]
        },
    )
    h = {"Coder-Session-Token": tok}
    async with httpx.AsyncClient(base_url=base, headers=h) as c:
        r = await c.post(
            P, json={"organization_id": org, "content": [{"type": "text", "text": "go"}]}
        )
        cid = r.json()["id"]
    ws_url = base.replace("http", "ws", 1) + f"{P}/{cid}/stream"
    parts = 0
    t0 = t1 = 0.0
    async with websockets.connect(
        ws_url, additional_headers=h, compression=None, max_size=None
    ) as ws:
        async for raw in ws:
            for ev in json.loads(raw):
                if ev["type"] == "message_part":
                    if parts == 0:
                        t0 = time.perf_counter()
                    parts += 1
                    t1 = time.perf_counter()
                elif ev["type"] == "status" and ev["status"]["status"] == "waiting":
                    return parts / (t1 - t0) if t1 > t0 else 0.0
    return 0.0


class RawConn:
    """A minimal keep-alive HTTP/1.1 client (httpx's pool dominates at 1,000 concurrent)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Coder-Session-Token: {self.token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        self.writer.write(head + data)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode().split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":")[1])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def turn_latency(env: dict[str, str], n: int, rounds: int) -> tuple[float, float, int]:
    base, tok, org = env["CODER_URL"], env["CODER_SESSION_TOKEN"], env["CODER_ORG_ID"]
    await set_default(
        base, env["CODER_EMULATOR_ADMIN_TOKEN"], {"text": "ok", "deltas": 1, "delay": 0}
    )
    h = {"Coder-Session-Token": tok}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    errors = 0
    async with httpx.AsyncClient(base_url=base, headers=h, limits=limits, timeout=60) as c:

        async def mk() -> str:
            r = await c.post(
                P, json={"organization_id": org, "content": [{"type": "text", "text": "hi"}]}
            )
            r.raise_for_status()
            return str(r.json()["id"])

        ids = await asyncio.gather(*(mk() for _ in range(n)))
        waiters: dict[str, asyncio.Future[float]] = {}
        ready = asyncio.Event()
        opened = 0

        async def hold(cid: str) -> None:
            nonlocal opened, errors
            url = base.replace("http", "ws", 1) + f"{P}/{cid}/stream"
            try:
                async with websockets.connect(
                    url, additional_headers=h, compression=None, open_timeout=60
                ) as ws:
                    opened += 1
                    if opened == n:
                        ready.set()
                    async for raw in ws:
                        for ev in json.loads(raw):
                            if ev["type"] == "status" and ev["status"]["status"] == "waiting":
                                fut = waiters.get(cid)
                                if fut is not None and not fut.done():
                                    fut.set_result(time.perf_counter())
            except Exception:
                errors += 1
                ready.set()

        holders = [asyncio.create_task(hold(cid)) for cid in ids]
        await asyncio.wait_for(ready.wait(), 120)
        await asyncio.sleep(0.2)  # let every chat finish its first turn
        lat: list[float] = []
        u = httpx.URL(base)
        conns = {cid: RawConn(u.host, u.port or 80, tok) for cid in ids}
        # warm the keep-alive connections so the measurement excludes TCP setup
        await asyncio.gather(*(rc.post("/__emulator__/none", {}) for rc in conns.values()))
        for _ in range(rounds):
            loop = asyncio.get_running_loop()

            async def one(cid: str, loop: asyncio.AbstractEventLoop = loop) -> None:
                nonlocal errors
                fut: asyncio.Future[float] = loop.create_future()
                waiters[cid] = fut
                t = time.perf_counter()
                status, _ = await conns[cid].post(
                    f"{P}/{cid}/messages", {"content": [{"type": "text", "text": "ping"}]}
                )
                if status != 200:
                    errors += 1
                    return
                lat.append(await asyncio.wait_for(fut, 60) - t)

            await asyncio.gather(*(one(cid) for cid in ids))
        for rc in conns.values():
            rc.close()
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    lat.sort()
    p50 = statistics.median(lat)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    return p50, p99, errors


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chats", default="1,100,1000")
    ap.add_argument("--deltas", type=int, default=20000)
    ap.add_argument("--era", default=None, help="server build to play (default: the CLI's)")
    args = ap.parse_args()
    proc, env = start_emulator(args.era)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # keep the load generator off the emulator's core
    try:
        eps = await events_per_second(env, args.deltas)
        print(f"one stream: {eps:,.0f} events/s ({args.deltas} text deltas)")
        for n in (int(x) for x in args.chats.split(",")):
            rounds = max(1, 50 // n) if n < 50 else 2
            p50, p99, errors = await turn_latency(env, n, rounds)
            print(
                f"{n:>5} chats with open streams: trivial turn p50 {p50 * 1000:.1f} ms, "
                f"p99 {p99 * 1000:.1f} ms, errors {errors}"
            )
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main())

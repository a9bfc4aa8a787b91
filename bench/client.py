"""Client benchmarks against one emulator running in its own process.

    .venv/bin/python bench/client.py [--turns 60] [--concurrent 200]

1. **Turn overhead**: a trivial turn (post a message on an existing chat, stream
   it to ``waiting``) through ``CoderAgent.generate`` vs the *floor* — a
   minimal raw ``httpx`` POST plus a ``websockets`` read of the same turn.
   Interleaved; prints p50/p90 and the p50 ratio (target <= 1.3x).
2. **Stream decode throughput** on a 10,000-delta reply: end to end through
   ``generate`` (bounded by the emulator, which shares the machine), and the
   client's decode pipeline alone (``parse_frame`` → replay dedup →
   ``TurnTranslator``) over the same frames captured off the wire
   (target ≥ 50,000 events/s).
3. **200 concurrent turns** in one process (each agent with its own
   ``ChatClient``): errors, and resident memory per open turn (RSS growth while
   every turn's stream is open / number of turns).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
from websockets.asyncio.client import connect

from coder_chat import ChatClient, CoderAgent
from coder_chat.core.dedup import ReplayFilter
from coder_chat.core.translator import TurnTranslator
from coder_chat.emulator.script import Script
from coder_chat.models import parse_frame

TOKEN = "bench-token-0123456789abcdef"
_CLOSING: set[asyncio.Task[None]] = set()


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class EmulatorProcess:
    def __init__(self, delta_delay: float = 0.0) -> None:
        self.delta_delay = delta_delay
        self.proc: subprocess.Popen[str] | None = None
        self.env: dict[str, str] = {}

    def __enter__(self) -> EmulatorProcess:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coder_chat.emulator.cli",
                "--token",
                TOKEN,
                "--delta-delay",
                str(self.delta_delay),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        while "CODER_EMULATOR_ADMIN_TOKEN" not in self.env:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("emulator did not start")
            key, _, value = line.strip().partition("=")
            self.env[key] = value
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(5)

    @property
    def url(self) -> str:
        return self.env["CODER_URL"]

    @property
    def org(self) -> str:
        return self.env["CODER_ORG_ID"]


def directive(script: Script, text: str = "bench") -> str:
    return f"{text} #emu {json.dumps(script.to_json())}"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


# --------------------------------------------------------------------------- floor


async def floor_turn(
    http: httpx.AsyncClient,
    ws_base: str,
    chat_id: str,
    prompt: str,
    record: list[str] | None = None,
) -> tuple[str, int, int]:
    """Raw: POST the message, read the stream from its id until status waiting."""
    resp = await http.post(
        f"/api/v2/chats/{chat_id}/messages",
        json={"content": [{"type": "text", "text": prompt}]},
    )
    resp.raise_for_status()
    after = resp.json()["message"]["id"]
    text: list[str] = []
    committed: list[str] = []
    events = 0
    ws = await connect(
        f"{ws_base}/api/v2/chats/{chat_id}/stream?after_id={after}",
        additional_headers={"Coder-Session-Token": TOKEN},
        compression=None,
        max_size=None,
    )
    try:
        while True:
            raw = await ws.recv()
            if record is not None:
                record.append(raw if isinstance(raw, str) else raw.decode())
            done = False
            for ev in json.loads(raw):
                events += 1
                if ev["type"] == "message_part" and ev["message_part"]["part"]["type"] == "text":
                    text.append(ev["message_part"]["part"]["text"])
                elif (
                    ev["type"] == "message"
                    and ev["message"]["role"] == "assistant"
                    and ev["message"]["id"] > after
                ):
                    committed.extend(
                        p["text"] for p in ev["message"]["content"] if p["type"] == "text"
                    )
                elif ev["type"] == "status" and ev["status"]["status"] == "waiting":
                    done = True
            if done:
                return "".join(committed) or "".join(text), events, after
    finally:
        # Like the agent, do not wait for the close handshake before returning.
        task = asyncio.get_running_loop().create_task(ws.close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)


# --------------------------------------------------------------------------- benches


async def bench_overhead(emu: EmulatorProcess, turns: int) -> dict[str, Any]:
    ws_base = emu.url.replace("http://", "ws://")
    async with (
        httpx.AsyncClient(base_url=emu.url, headers={"Coder-Session-Token": TOKEN}) as http,
        ChatClient(emu.url, TOKEN, organization_id=emu.org) as client,
    ):
        agent = CoderAgent(client=client)
        await agent.generate("warm up")
        chat_id = agent.chat_id
        assert chat_id is not None
        floor_chat = (
            await http.post(
                "/api/v2/chats",
                json={"organization_id": emu.org, "content": [{"type": "text", "text": "warm"}]},
            )
        ).json()["id"]
        await asyncio.sleep(0.2)
        await floor_turn(http, ws_base, floor_chat, "warm up")
        agent_ms: list[float] = []
        floor_ms: list[float] = []
        for i in range(turns):
            t0 = time.perf_counter()
            r = await agent.generate(f"hello {i}")
            agent_ms.append((time.perf_counter() - t0) * 1000)
            assert r.text == f"Echo: hello {i}", r.text
            t0 = time.perf_counter()
            text, _, _ = await floor_turn(http, ws_base, floor_chat, f"hello {i}")
            floor_ms.append((time.perf_counter() - t0) * 1000)
            assert text == f"Echo: hello {i}", text
        await agent.aclose()
    return {
        "agent_p50_ms": statistics.median(agent_ms),
        "agent_p90_ms": pct(agent_ms, 0.9),
        "floor_p50_ms": statistics.median(floor_ms),
        "floor_p90_ms": pct(floor_ms, 0.9),
        "p50_ratio": statistics.median(agent_ms) / statistics.median(floor_ms),
    }


async def bench_throughput(emu: EmulatorProcess, deltas: int) -> dict[str, Any]:
    body = "".join(chr(ord("a") + i % 26) for i in range(deltas))
    script = Script.text(body, deltas=deltas)
    async with ChatClient(emu.url, TOKEN, organization_id=emu.org) as client:
        agent = CoderAgent(client=client)
        await agent.generate("warm up")
        t0 = time.perf_counter()
        r = await agent.generate(directive(script))
        e2e = time.perf_counter() - t0
        assert r.text == body
        # the floor reads the same reply raw (and records the frames for the decode bench)
        frames: list[str] = []
        async with httpx.AsyncClient(
            base_url=emu.url, headers={"Coder-Session-Token": TOKEN}
        ) as http:
            t0 = time.perf_counter()
            text, events, after = await floor_turn(
                http,
                emu.url.replace("http://", "ws://"),
                agent.chat_id or "",
                directive(script),
                frames,
            )
            floor_s = time.perf_counter() - t0
        assert text == body
        await agent.aclose()
    # decode pipeline alone, over the captured frames (best of 5)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        replay = ReplayFilter()
        tr = TurnTranslator(cursor=after)
        n = 0
        for raw in frames:
            for ev in parse_frame(raw):
                n += 1
                if replay.observe(ev).forward:
                    tr.feed(ev)
        best = min(best, time.perf_counter() - t0)
    assert tr.text == body, (len(tr.text), len(body))
    assert n == events, (n, events)
    return {
        "events": events,
        "generate_s": e2e,
        "generate_events_per_s": events / e2e,
        "floor_s": floor_s,
        "floor_events_per_s": events / floor_s,
        "decode_events_per_s": events / best,
    }


async def bench_concurrency(
    emu: EmulatorProcess, n: int, shared: ChatClient | None = None
) -> dict[str, Any]:
    hold = Script.long_running(3.0, text="all done", chunks=6)
    gc.collect()
    before = rss_kib()
    # Constructed after the baseline: with no shared client each agent's own
    # ChatClient (httpx pool, TLS context) is part of what an open turn costs.
    agents = [
        CoderAgent(client=shared, request_timeout=60)
        if shared is not None
        else CoderAgent(base_url=emu.url, token=TOKEN, organization_id=emu.org, request_timeout=60)
        for _ in range(n)
    ]
    peak = before
    tasks = [
        asyncio.create_task(a.generate(directive(hold, f"job {i}"))) for i, a in enumerate(agents)
    ]
    t0 = time.perf_counter()
    while not all(t.done() for t in tasks):
        peak = max(peak, rss_kib())
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - t0
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    ok = sum(1 for r in results if not isinstance(r, BaseException) and r.text == "all done")
    for a in agents:
        await a.aclose()
    return {
        "turns": n,
        "ok": ok,
        "errors": len(errors),
        "error_kinds": sorted({type(e).__name__ for e in errors}),
        "wall_s": wall,
        "rss_before_mib": before / 1024,
        "rss_peak_mib": peak / 1024,
        "kib_per_open_turn": (peak - before) / n,
    }


def _report(label: str, c: dict[str, Any]) -> None:
    print(
        f"[concurrency, {label}] {c['turns']} turns: {c['ok']} ok, {c['errors']} errors "
        f"{c['error_kinds']}, wall {c['wall_s']:.2f} s, RSS {c['rss_before_mib']:.1f} -> "
        f"{c['rss_peak_mib']:.1f} MiB = {c['kib_per_open_turn']:.0f} KiB per open turn"
    )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--deltas", type=int, default=10_000)
    ap.add_argument("--concurrent", type=int, default=200)
    ap.add_argument("--concurrency-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.concurrency_only:
        # Own process: RSS growth is not hidden by memory the other benches freed.
        with EmulatorProcess(delta_delay=0.005) as emu:
            async with ChatClient(emu.url, TOKEN, organization_id=emu.org) as shared:
                await CoderAgent(client=shared).generate("warm up")
                c = await bench_concurrency(emu, args.concurrent, shared)
                _report("one shared ChatClient", c)
            c = await bench_concurrency(emu, args.concurrent)
            _report("a ChatClient per agent", c)
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; emulator in a subprocess")
    with EmulatorProcess(delta_delay=0.0) as emu:
        o = await bench_overhead(emu, args.turns)
        print(
            f"[turn] generate p50 {o['agent_p50_ms']:.2f} ms (p90 {o['agent_p90_ms']:.2f}) | "
            f"floor p50 {o['floor_p50_ms']:.2f} ms (p90 {o['floor_p90_ms']:.2f}) | "
            f"p50 ratio {o['p50_ratio']:.2f}x (target <= 1.3x)"
        )
        t = await bench_throughput(emu, args.deltas)
        print(
            f"[stream] {t['events']} events: generate {t['generate_events_per_s']:,.0f} ev/s "
            f"({t['generate_s']:.2f} s), raw floor {t['floor_events_per_s']:,.0f} ev/s "
            f"({t['floor_s']:.2f} s), client decode pipeline alone "
            f"{t['decode_events_per_s']:,.0f} ev/s (target >= 50,000)"
        )
    sys.stdout.flush()
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--concurrency-only", "--concurrent", str(args.concurrent)
    )
    await child.wait()


if __name__ == "__main__":
    asyncio.run(main())

"""A ``ChatClient`` on an ``http://`` Coder URL loads no CA bundle (docs/performance.md,
round 10d): every flow run is a fresh process with one client, and certifi's bundle cost
it ≈ 60 ms of CPU for a context a plain-http pool never uses. An ``https://`` client
still gets the shared, verifying context.

A fresh interpreter counts the CA loads for real: ``sys.setprofile`` sees every call of
``SSLContext.load_verify_locations`` / ``load_default_certs`` /
``set_default_verify_paths`` (C methods report ``c_call``), whoever makes it.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys

from coder_chat.rest import _plain_http_context

_CHILD = r"""
import asyncio, json, ssl, sys
from coder_chat.rest import ChatClient, shared_ssl_context

LOADS = {"load_verify_locations", "load_default_certs", "set_default_verify_paths"}
loads = []

def profile(frame, event, arg):
    if event == "c_call" and getattr(arg, "__name__", "") in LOADS:
        loads.append(arg.__name__)

CHAT = json.dumps({
    "id": "c0ffee00-0000-4000-8000-000000000001", "owner_id": "u1", "title": "t",
    "status": "waiting", "created_at": "2026-01-01T00:00:00Z",
    "updated_at": "2026-01-01T00:00:00Z",
}).encode()

async def serve(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(CHAT)}\r\n\r\n".encode() + CHAT)
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sys.setprofile(profile)
    async with ChatClient(f"http://127.0.0.1:{port}", "tok-lazy-tls") as client:
        chat = await client.get_chat("c0ffee00-0000-4000-8000-000000000001")
    http_loads = list(loads)
    http_cached = shared_ssl_context.cache_info().currsize
    https = ChatClient("https://coder.example.com", "tok-lazy-tls")
    https_loads = len(loads) - len(http_loads)
    same = https.ssl_context is shared_ssl_context(True)
    await https.aclose()
    sys.setprofile(None)
    server.close()
    print(json.dumps({
        "chat": str(chat.id), "http_loads": http_loads, "http_cached": http_cached,
        "https_loads": https_loads, "https_shared": same,
        "https_verifies": https.ssl_context.verify_mode == ssl.CERT_REQUIRED,
    }))

asyncio.run(main())
"""


def test_http_client_loads_no_ca_bundle() -> None:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["chat"] == "c0ffee00-0000-4000-8000-000000000001"  # a real request ran
    # Before round 10d: one load_verify_locations (the shared context, built per process).
    assert seen["http_loads"] == []
    assert seen["http_cached"] == 0
    # https is unchanged: the shared verifying context, its CAs loaded once.
    assert seen["https_loads"] >= 1
    assert seen["https_shared"] and seen["https_verifies"]


def test_plain_http_context_fails_closed() -> None:
    # Never used for TLS; if it ever were, it trusts no CA and still checks the
    # certificate and hostname: a connection fails rather than go unverified.
    ctx = _plain_http_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] == 0

"""A tiny real HTTP "payments" service (test-only) that counts effects per Idempotency-Key.

``POST /charge`` with header ``Idempotency-Key`` and JSON ``{"amount_cents": n}``:
the first request with a key applies the effect (counted), every later one with
the same key replays the recorded answer (not counted). ``GET /stats`` returns
``{"effects": {key: n}, "requests": {key: n}}``.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Payments:
    """State of the service (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.effects: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.answers: dict[str, dict[str, Any]] = {}
        self.url = ""

    def charge(self, key: str, amount: int) -> dict[str, Any]:
        with self.lock:
            self.requests[key] += 1
            if key not in self.answers:
                self.effects[key] += 1
                self.answers[key] = {"charged_cents": amount, "status": "charged"}
            return self.answers[key]

    def effects_with_prefix(self, prefix: str) -> dict[str, int]:
        with self.lock:
            return {k: v for k, v in self.effects.items() if prefix in k}


def _handler(state: Payments) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            return

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            key = self.headers.get("Idempotency-Key")
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not key:
                self._send(400, {"error": "Idempotency-Key required"})
                return
            self._send(200, state.charge(key, int(body.get("amount_cents", 0))))

        def do_GET(self) -> None:
            with state.lock:
                self._send(200, {"effects": dict(state.effects), "requests": dict(state.requests)})

    return Handler


@contextmanager
def running_payments() -> Iterator[Payments]:
    state = Payments()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()

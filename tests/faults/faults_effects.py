"""The test tool's own effect log: what really happened at the "external system".

A charge service that honours idempotency keys, as a real payments API does: the
first request with a key applies the charge, a repeat returns the same receipt. Every
request is appended to a JSON-lines file (one process or many), so a test counts
effects and requests per key from the file, not from anything the product reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class EffectLog:
    """``charge(key, cents)`` applies once per key; ``effects``/``requests`` count them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def charge(self, key: str, cents: int) -> dict[str, Any]:
        applied = not any(r["key"] == key and r["applied"] for r in self._lines())
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, "cents": cents, "applied": applied}) + "\n")
        return {"receipt": f"rcpt-{key.rsplit('/', 1)[-1]}", "charged_cents": cents}

    def effects(self, key: str | None = None) -> int:
        """Charges applied (for ``key``, or in all)."""
        return sum(1 for r in self._lines() if r["applied"] and key in (None, r["key"]))

    def requests(self, key: str) -> int:
        return sum(1 for r in self._lines() if r["key"] == key)

    def keys(self) -> set[str]:
        return {r["key"] for r in self._lines()}

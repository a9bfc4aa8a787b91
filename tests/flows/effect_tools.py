"""A plain registered tool with a real side effect, for the crash-safe-by-default tests.

``bump_counter`` is declared with plain ``@registered_tool`` (no crash-safe
decorator): the workflow runs it behind the tool ledger anyway. Every call is
recorded in ``calls``; the effect itself is applied to ``effects`` only once per
idempotency key (``INSERT OR IGNORE`` — an external system that honours keys).
Both tables live in the SQLite file named by ``EFFECT_DB``, so a killed process
and the recovering one count into the same place.
"""

from __future__ import annotations

import os
import sqlite3

from pydantic import BaseModel

from coder_chat.tools import ToolContext
from prefect_coder.tools import registered_tool

__all__ = ["Bump", "bump_counter", "effect_rows"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS calls (n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, pid INTEGER)",
    "CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, amount INTEGER)",
)


class Bump(BaseModel):
    """Arguments of ``bump_counter``."""

    amount: int


def _db() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["EFFECT_DB"], timeout=10, isolation_level=None)
    for stmt in _SCHEMA:
        conn.execute(stmt)
    return conn


@registered_tool(name="bump_counter", description="Add an amount to the shared counter.")
async def bump_counter(args: Bump, ctx: ToolContext) -> dict[str, object]:
    """The effect: applied once per ``ctx.idempotency_key``, every call recorded."""
    with _db() as conn:
        conn.execute(
            "INSERT INTO calls (key, pid) VALUES (?, ?)", (ctx.idempotency_key, os.getpid())
        )
        conn.execute(
            "INSERT OR IGNORE INTO effects (key, amount) VALUES (?, ?)",
            (ctx.idempotency_key, args.amount),
        )
    return {"bumped": args.amount}


def effect_rows(path: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(calls as (key, pid), effects as (key, amount)) from the SQLite file ``path``."""
    conn = sqlite3.connect(path)
    try:
        calls = conn.execute("SELECT key, pid FROM calls ORDER BY n").fetchall()
        effects = conn.execute("SELECT key, amount FROM effects").fetchall()
    finally:
        conn.close()
    return calls, effects

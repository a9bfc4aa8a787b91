"""First smoke test of the SQLite store (full backend-parametrized suite follows)."""

from pathlib import Path

from blocks import JournalEntry, StateStore


async def test_roundtrip(tmp_path: Path) -> None:
    async with StateStore(f"sqlite+aiosqlite:///{tmp_path}/a/state.db") as store:
        assert await store.checkpoints.get("wf") is None
        cp = await store.checkpoints.set("wf", "chat-1", 7)
        assert (await store.checkpoints.get("wf")) == cp
        await store.journal.set("chat-1", JournalEntry(state="submitting", marker="m", attempt=0))
        assert (await store.journal.get("chat-1")).state == "submitting"  # type: ignore[union-attr]

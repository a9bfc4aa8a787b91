"""The ``prefect.collections`` entry point (``prefect_coder`` → ``prefect_coder.blocks``)
does not import the state store: Prefect imports every installed collection in each
``prefect worker start``, ``prefect deploy`` and CLI process, and the store brings
SQLAlchemy (≈ 1 CPU-s per worker start measured, docs/performance.md round 10c). The
store's names still come from ``prefect_coder.blocks``, on first access."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import prefect_coder.blocks as blocks
from prefect_coder.blocks import ChatStateStore, state
from prefect_coder.blocks import chat_state_store as css
from prefect_coder.blocks.state import urls

#: In a fresh interpreter: what Prefect's own collection loading (a worker's start,
#: a block type lookup) imports, what the operator CLI imports, and that the store
#: still works when it is first used.
_CHILD = r"""
import json, sys
from prefect.plugins import load_prefect_collections
loaded = sorted(load_prefect_collections())
after_collections = sorted(m for m in sys.modules if m.split(".")[0] == "sqlalchemy")
import prefect_coder.cli
after_cli = sorted(m for m in sys.modules if m.split(".")[0] == "sqlalchemy")
from prefect_coder.blocks import ChatStateStore
store = ChatStateStore(url="sqlite+aiosqlite:///" + sys.argv[1]).get_store()
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import HeldLease, workflow_key
print(json.dumps({
    "collections": loaded,
    "sqlalchemy_after_collections": len(after_collections),
    "sqlalchemy_after_cli": len(after_cli),
    "store": type(store).__name__,
    "store_is_exported": type(store) is StateStore,
    "sqlalchemy_after_store": "sqlalchemy" in sys.modules,
    "lease": HeldLease.__module__,
    "key": workflow_key("wf-1"),
}))
"""


def test_collection_entry_point_leaves_sqlalchemy_out(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "state.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "prefect_coder" in seen["collections"]
    # Before round 10c: 158 SQLAlchemy modules after the collection's import alone.
    assert seen["sqlalchemy_after_collections"] == 0
    assert seen["sqlalchemy_after_cli"] == 0
    assert seen["store"] == "StateStore" and seen["store_is_exported"]
    assert seen["sqlalchemy_after_store"]
    assert seen["lease"] == "prefect_coder.blocks.state.leases"
    assert seen["key"] == state.workflow_key("wf-1")


def test_lazy_names_are_the_state_packages() -> None:
    for name in blocks._FROM_STATE:
        assert getattr(blocks, name) is getattr(state, name), name
        assert name in dir(blocks)
    assert set(blocks.__all__) == blocks._FROM_STATE | {
        "ChatStateStore",
        "CoderCredentials",
        "InvalidCoderCredentialsError",
    }


def test_spelled_out_sqlite_scheme_matches_the_store() -> None:
    assert css._SQLITE_SCHEME == urls.SQLITE_SCHEME
    url_field = ChatStateStore.model_fields["url"]
    assert f"{urls.SQLITE_SCHEME}:///$PREFECT_HOME" in (url_field.description or "")

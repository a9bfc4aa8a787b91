"""Every name the docs, examples and error messages tell a user to import comes from a
public module, and imports from there.

The public modules are the front doors (``prefect_coder``, ``prefect_coder.tools``,
``prefect_coder.errors``, ``prefect_coder.blocks``, ``prefect_coder.flows``), the
store's own API (``prefect_coder.blocks.state``, docs/state-store.md), the deployment
entrypoints that prefect.yaml names (``prefect_coder.flows.deployments.*``) and the
client (``coder_chat`` and its modules). The rooms under ``prefect_coder.flows``
(``common``, ``observe``, ``fleet``, ``recovery``, ``sweeps``, ``turn``, ``workflow``)
are internal: they may move between releases, so no doc may send a user there.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PUBLIC_MODULES = (
    "prefect_coder",
    "prefect_coder.tools",
    "prefect_coder.errors",
    "prefect_coder.blocks",
    "prefect_coder.blocks.state",
    "prefect_coder.flows",
)

#: The front door's promises: module → names (docs/architecture.md, README).
DOCUMENTED = {
    "prefect_coder": [
        "ChatStateStore",
        "CoderCredentials",
        "PrefectCoderError",
        "Step",
        "ToolContext",
        "TurnResult",
        "WorkflowSettings",
        "agent_fanout",
        "agent_turn",
        "agent_workflow",
        "output_model",
        "recover_turn",
        "registered_tool",
        "run_turn",
    ],
    "prefect_coder.tools": ["ToolContext", "output_model", "register_tool", "registered_tool"],
    "prefect_coder.blocks": [
        "ChatStateStore",
        "CoderCredentials",
        "InvalidCoderCredentialsError",
        "StateStore",
    ],
    "prefect_coder.flows": [
        "ApprovalStep",
        "FanoutItem",
        "ModelStep",
        "Step",
        "WorkflowSettings",
        "result_key",
    ],
    "prefect_coder.errors": ["PrefectCoderError", "WorkflowParameterError", "StateStoreError"],
}


def _is_public(module: str) -> bool:
    if module in PUBLIC_MODULES or module.split(".")[0] == "coder_chat":
        return True
    return module.startswith("prefect_coder.flows.deployments.")


def _doc_sources() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.py")),
    ]


_FROM_IMPORT = re.compile(
    r"^\s*from\s+((?:prefect_coder|coder_chat)[\w.]*)\s+import\s+([\w, ()]+)", re.M
)


def documented_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) for every ``from … import …`` of ours in README, docs, examples."""
    found = []
    for path in _doc_sources():
        for match in _FROM_IMPORT.finditer(path.read_text()):
            names = [n.strip() for n in match.group(2).strip("()").split(",") if n.strip()]
            for name in names:
                found.append((str(path.relative_to(ROOT)), match.group(1), name.split(" as ")[0]))
    return found


def test_the_docs_are_read() -> None:
    # Guards against a scan that sees nothing.
    assert len(documented_imports()) > 20


@pytest.mark.parametrize(("module", "names"), sorted(DOCUMENTED.items()))
def test_each_front_door_name_imports_and_is_exported(module: str, names: list[str]) -> None:
    mod = importlib.import_module(module)
    for name in names:
        assert name in mod.__all__, f"{module}.__all__ lacks {name}"
        assert getattr(mod, name) is not None
    # And nothing in __all__ is a dangling promise.
    for name in mod.__all__:
        getattr(mod, name)


def test_the_front_door_names_are_the_real_objects() -> None:
    import prefect_coder
    from prefect_coder.flows.common import registry
    from prefect_coder.flows.common.params import Step

    assert prefect_coder.registered_tool is registry.registered_tool
    assert prefect_coder.Step is Step


def test_every_documented_import_comes_from_a_public_module_and_works() -> None:
    bad, broken = [], []
    for where, module, name in documented_imports():
        if not _is_public(module):
            bad.append(f"{where}: from {module} import {name}")
            continue
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                broken.append(f"{where}: from {module} import {name}")
    assert not bad, "docs send users to internal modules:\n" + "\n".join(bad)
    assert not broken, "documented imports that fail:\n" + "\n".join(broken)


def test_error_messages_name_public_paths() -> None:
    # The messages a user reads in the Prefect UI tell them what to import: a dotted
    # path like ``@prefect_coder.x.y`` in a string of the product must resolve publicly.
    dotted = re.compile(r"@?(prefect_coder(?:\.\w+)+)")
    bad = []
    for path in sorted((ROOT / "flows").rglob("*.py")) + sorted((ROOT / "blocks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for ref in dotted.findall(node.value):
                    module, _, attr = ref.rpartition(".")
                    if ("register" in attr or "output_model" in attr) and not _is_public(module):
                        bad.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not bad, "error messages name internal paths:\n" + "\n".join(bad)


def test_the_blocks_package_keeps_store_internals_out_of_its_surface() -> None:
    import prefect_coder.blocks as blocks

    for internal in ("JournalEntry", "StoreTransaction", "chat_key", "workflow_key", "HeldLease"):
        assert internal not in blocks.__all__
        assert not hasattr(blocks, internal), f"prefect_coder.blocks.{internal} is reachable"


def test_every_product_error_survives_pickling() -> None:
    # Prefect persists a failed task's or flow's exception (and ships it between
    # processes): an error that cannot be rebuilt turns a clear failure into a
    # TypeError about missing arguments.
    import pickle

    from coder_chat.follow_target import NoTurnToFollowError
    from prefect_coder import errors

    samples: list[Exception] = [
        NoTurnToFollowError("chat-1", 4, None, "[wf/s]"),
        errors.WorkflowParameterError("settings.lease_ttl_s", "too long", "use at most 3600"),
        errors.WorkflowBusyError("wf-1", 2.5),
        errors.TurnSlotUnavailableError(5, 60.0),
        errors.TurnSlotLostError(2, 31.0),
        errors.StructuredAnswerError("s", "plan", "chat-1", 2),
        errors.ChatNotArchivedError("chat-1 did not archive"),
        errors.LeaseLostError("wf/wf-1", "holder-1"),
        errors.LeaseUnavailableError("wf/wf-1", holder="h", expires_in=3.0, waited=1.5),
        errors.SchemaVersionError("schema 9 is newer than this code (4)"),
        errors.SchemaChangedError(5, 4),
        errors.ResultNotPersistedError("wf-1", "plan", "k", "PermissionError"),
        errors.StoreUnavailableError("sqlite:///x", "database is locked", backend="sqlite"),
        errors.StateStoreError("the store failed"),
        errors.StateStoreConfigError("url: not a database URL"),
        errors.InvalidCoderCredentialsError("coder", "base_url: must be an http(s) URL"),
    ]
    # Every error the front door exports has a sample here.
    exported = {n for n in errors.__all__ if n != "PrefectCoderError"}
    assert exported <= {type(e).__name__ for e in samples}, exported
    for exc in samples:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc), exc
        assert isinstance(back, errors.PrefectCoderError) or type(back) is NoTurnToFollowError

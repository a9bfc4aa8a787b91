"""The public surface of ``coder_chat`` and its import structure."""

from __future__ import annotations

import ast
import importlib
import pathlib

import coder_chat

PACKAGE = pathlib.Path(coder_chat.__file__).parent


def test_public_surface_is_the_client_not_recovery_internals() -> None:
    exported = set(coder_chat.__all__)
    assert {"ChatClient", "CoderAgent", "CoderError", "stop_chat", "StopResult"} <= exported
    internals = {
        "count_marker_attempts",
        "fetch_turn",
        "fetch_until",
        "marker_attempts",
        "recover_turn",
        "recover_turn_result",
        "RecoveredTurn",
    }
    assert not exported & internals
    for name in exported:
        assert hasattr(coder_chat, name), name
    # still importable from their modules
    history = importlib.import_module("coder_chat.history")
    for name in internals - {"recover_turn"}:
        assert hasattr(history, name), name
    assert not hasattr(history, "recover_turn")  # renamed: it clashed with the flow
    assert hasattr(importlib.import_module("coder_chat.core.recovery"), "RecoveryDecision")


def test_submodules_never_import_the_package() -> None:
    """``__init__`` imports submodules; a submodule importing ``coder_chat`` itself would
    close a cycle (and break importing that submodule first)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "coder_chat":
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Import) and any(a.name == "coder_chat" for a in node.names):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_no_import_cycle_between_submodules() -> None:
    """Module-level imports between coder_chat's modules form no cycle (the emulator is
    a separate program and never imports the client)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if name == "coder_chat":
            continue
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {
            node.module
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("coder_chat.")
        }
    assert "coder_chat.stop" in graph and "coder_chat.core.backoff" in graph
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path, node]))
        if node in done or node not in graph:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])

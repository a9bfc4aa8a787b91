"""The import layers hold: no import cycle anywhere, ``coder_chat`` free of Prefect,
and the flows' layers import only downward (docs/architecture.md).

The graph is read from the source with ``ast`` — no module is imported — and
counts every runtime import, also the ones inside functions (a function-level
import that works around a circle is still a circle); imports under
``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Source folder → the package name it is installed as (pyproject's package-dir).
PACKAGES = {
    "coder_chat": "coder_chat",
    "prefect_coder": "prefect_coder",
    "flows": "prefect_coder.flows",
    "blocks": "prefect_coder.blocks",
}

#: The flows' layers, bottom first, each a tuple of rooms (sub-packages of
#: ``prefect_coder.flows``). A module may import its own layer and the layers below
#: it, never one above; rooms of one layer may import each other one way only.
FLOW_LAYERS: tuple[tuple[str, ...], ...] = (
    ("observe", "common", "fleet", "recovery", "sweeps", "liveness"),
    ("turn",),
    ("workflow",),
    ("deployments",),
)
#: Every room, and the layer it is in.
FLOW_ROOMS = {room: rank for rank, rooms in enumerate(FLOW_LAYERS) for room in rooms}
#: Flows modules outside the rooms, and the room they count as.
FLOW_LOOSE = {"prefect_coder.flows.demo_tools": "common"}


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target as written (resolved to an absolute name)."""

    target: str
    names: tuple[str, ...]
    line: int
    type_checking: bool


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Every module of ``packages`` (source folder → installed name), by dotted name."""
    found: dict[str, Path] = {}
    for folder, name in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if any((base / up).is_symlink() for up in rel.parents):
                continue  # prefect_coder/flows -> ../flows: read once, as its own folder
            parts = rel.with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_checking: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_checking
                yield from _walk(stmt, type_checking)
            continue
        yield child, type_checking
        yield from _walk(child, type_checking)


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import in ``path`` (module-level and inside functions or classes)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node, tc in _walk(tree, False):
        if isinstance(node, ast.Import):
            found += [Import(a.name, (), node.lineno, tc) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append(Import(target, tuple(a.name for a in node.names), node.lineno, tc))
    return found


Parsed = dict[str, list[Import]]


def parse_all(modules: dict[str, Path]) -> Parsed:
    """The imports of every module (each file parsed once)."""
    return {module: imports_of(module, path) for module, path in modules.items()}


def edges(parsed: Parsed) -> dict[str, dict[str, int]]:
    """Runtime import edges between the parsed modules: importer → {imported: line}.

    ``from package import name`` points at ``package.name`` when that is a module
    of the tree, else at ``package`` itself (whose ``__init__`` must run first).
    """
    modules = parsed
    graph: dict[str, dict[str, int]] = {m: {} for m in parsed}
    for module, found in parsed.items():
        for imp in found:
            if imp.type_checking:
                continue
            targets = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]
            if len(targets) < len(imp.names) or not imp.names:
                targets.append(imp.target)
            for target in targets:
                if target in modules and target != module:
                    graph[module].setdefault(target, imp.line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """A cycle's modules and the import lines that close it."""
    members = set(component)
    lines = [
        f"    {a} -> {b} (line {line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    return "cycle of " + ", ".join(component) + ":\n" + "\n".join(lines)


def flow_room(module: str) -> str | None:
    """The room of a ``prefect_coder.flows`` module (None: not in a room)."""
    if module in FLOW_LOOSE:
        return FLOW_LOOSE[module]
    parts = module.split(".")
    if parts[:2] != ["prefect_coder", "flows"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in FLOW_ROOMS else None


def flow_layer(module: str) -> int | None:
    """The layer rank of a ``prefect_coder.flows`` module (None: not in a layer)."""
    room = flow_room(module)
    return None if room is None else FLOW_ROOMS[room]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from a flows layer into a layer above it."""
    bad = []
    for module, targets in sorted(graph.items()):
        rank = flow_layer(module)
        if rank is None:
            continue
        for target, line in sorted(targets.items()):
            above = flow_layer(target)
            if above is not None and above > rank:
                bad.append(
                    f"{module} (room {flow_room(module)}, layer {rank}) imports {target} "
                    f"(room {flow_room(target)}, layer {above}) at line {line}"
                )
    return bad


def room_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """The flows' rooms as a graph: room → {room it imports: one import that shows it}."""
    rooms: dict[str, dict[str, str]] = {room: {} for room in FLOW_ROOMS}
    for module, targets in sorted(graph.items()):
        source = flow_room(module)
        if source is None:
            continue
        for target, line in sorted(targets.items()):
            dest = flow_room(target)
            if dest is not None and dest != source:
                rooms[source].setdefault(dest, f"{module} -> {target} (line {line})")
    return rooms


def imports_matching(parsed: Parsed, importer_prefix: str, forbidden: Iterable[str]) -> list[str]:
    """Imports (TYPE_CHECKING ones too) of a forbidden top-level name under a prefix."""
    tops = set(forbidden)
    bad = []
    for module, found in sorted(parsed.items()):
        if module != importer_prefix and not module.startswith(importer_prefix + "."):
            continue
        for imp in found:
            if imp.target.split(".")[0] in tops:
                bad.append(f"{module} imports {imp.target} at line {imp.line}")
    return bad


# --------------------------------------------------------------------------- the tree


Tree = tuple[Parsed, dict[str, dict[str, int]]]


@pytest.fixture(scope="module")
def tree() -> Tree:
    parsed = parse_all(module_files(ROOT, PACKAGES))
    return parsed, edges(parsed)


def test_the_tree_is_read(tree: Tree) -> None:
    modules, graph = tree
    # Guards against a checker that sees nothing (a wrong root or package map).
    for folder, name in PACKAGES.items():
        assert name in modules, f"{folder}/__init__.py not found under {ROOT}"
    for room in FLOW_ROOMS:
        assert f"prefect_coder.flows.{room}" in modules
    assert sum(len(t) for t in graph.values()) > 100


def test_no_import_cycle_in_the_flows_and_blocks(
    tree: Tree,
) -> None:
    _, graph = tree
    found = [c for c in cycles(graph) if any(m.startswith("prefect_coder") for m in c)]
    assert not found, "import cycles (runtime imports, function-level included):\n" + "\n".join(
        describe(c, graph) for c in found
    )


def test_no_import_cycle_in_coder_chat(
    tree: Tree,
) -> None:
    _, graph = tree
    found = [c for c in cycles(graph) if all(m.startswith("coder_chat") for m in c)]
    assert not found, (
        "coder_chat has import cycles (runtime imports, function-level included); "
        "the flows' layering is not the cause — fix them in coder_chat:\n"
        + "\n".join(describe(c, graph) for c in found)
    )


def test_coder_chat_never_imports_prefect(
    tree: Tree,
) -> None:
    modules, _ = tree
    bad = imports_matching(modules, "coder_chat", ["prefect", "prefect_coder"])
    assert not bad, "coder_chat must stay usable without Prefect:\n" + "\n".join(bad)


def test_blocks_never_import_the_flows(
    tree: Tree,
) -> None:
    _, graph = tree
    bad = [
        f"{m} imports {t} at line {line}"
        for m, targets in sorted(graph.items())
        if m.startswith("prefect_coder.blocks")
        for t, line in targets.items()
        if t.startswith("prefect_coder.flows")
    ]
    assert not bad, "blocks sit below the flows:\n" + "\n".join(bad)


def test_flows_layers_import_only_downward(
    tree: Tree,
) -> None:
    modules, graph = tree
    unplaced = [
        m for m in modules if m.startswith("prefect_coder.flows.") and flow_layer(m) is None
    ]
    assert not unplaced, f"flows modules outside the layers {FLOW_LAYERS}: {unplaced}"
    bad = upward_imports(graph)
    assert not bad, "a flows layer imports a layer above it:\n" + "\n".join(bad)


def test_sibling_rooms_never_import_each_other_both_ways(
    tree: Tree,
) -> None:
    # A circle between rooms is a circle of ideas even when no module circle closes
    # it: each room must be readable knowing only the rooms below it.
    _, graph = tree
    rooms = room_graph(graph)
    found = cycles({room: dict.fromkeys(targets, 0) for room, targets in rooms.items()})
    assert not found, "flows rooms import each other in a circle:\n" + "\n".join(
        ", ".join(c)
        + ":\n"
        + "\n".join(f"    {rooms[a][b]}" for a in c for b in rooms[a] if b in c)
        for c in found
    )


# --------------------------------------------------------------------------- the checker


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_function_level_cycles_and_ignores_type_checking(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import thing\n",
            "pkg/a.py": "thing = 1\ndef f():\n    from pkg import b\n",
            "pkg/b.py": "from . import a\n",
            "pkg/c.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import d\nelse:\n    import json\n"
            ),
            "pkg/d.py": "import pkg.c\n",
        },
    )
    modules = module_files(tmp_path, {"pkg": "pkg"})
    graph = edges(parse_all(modules))
    assert graph["pkg.a"] == {"pkg.b": 3}  # the function-level import counts
    assert graph["pkg.b"] == {"pkg.a": 1}  # relative, resolved to the submodule
    assert graph["pkg.c"] == {}  # TYPE_CHECKING left out
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b"]]
    assert "pkg.a -> pkg.b (line 3)" in describe(found[0], graph)


def test_checker_sees_a_package_init_cycle(tmp_path: Path) -> None:
    # __init__ imports a submodule that imports a name from the package itself.
    _write(tmp_path, {"pkg/__init__.py": "from .x import y\n", "pkg/x.py": "from pkg import z\n"})
    graph = edges(parse_all(module_files(tmp_path, {"pkg": "pkg"})))
    assert cycles(graph) == [["pkg", "pkg.x"]]


def test_checker_flags_an_upward_flows_import() -> None:
    graph = {
        "prefect_coder.flows.common.a": {"prefect_coder.flows.turn.b": 7},
        "prefect_coder.flows.turn.b": {"prefect_coder.flows.common.a": 3},
        "prefect_coder.flows.deployments.c": {"prefect_coder.flows.workflow.d": 1},
        "prefect_coder.flows.workflow.d": {},
    }
    assert upward_imports(graph) == [
        "prefect_coder.flows.common.a (room common, layer 0) imports "
        "prefect_coder.flows.turn.b (room turn, layer 1) at line 7"
    ]


def test_checker_flags_sibling_rooms_in_a_circle() -> None:
    graph = {
        "prefect_coder.flows.fleet.a": {"prefect_coder.flows.sweeps.b": 4},
        "prefect_coder.flows.sweeps.b": {"prefect_coder.flows.sweeps.c": 2},
        # A function-level import back (the graph counts it) closes the room circle
        # although no module imports its own importer.
        "prefect_coder.flows.sweeps.c": {"prefect_coder.flows.fleet.d": 9},
        "prefect_coder.flows.fleet.d": {},
        "prefect_coder.flows.observe.e": {},
    }
    rooms = room_graph(graph)
    assert rooms["fleet"] == {
        "sweeps": "prefect_coder.flows.fleet.a -> prefect_coder.flows.sweeps.b (line 4)"
    }
    assert rooms["sweeps"] == {
        "fleet": "prefect_coder.flows.sweeps.c -> prefect_coder.flows.fleet.d (line 9)"
    }
    assert not cycles(graph)  # no module circle
    assert cycles({r: dict.fromkeys(t, 0) for r, t in rooms.items()}) == [["fleet", "sweeps"]]

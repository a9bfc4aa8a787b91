"""docs/architecture.md draws the tree as it is: every package and module of the
installed packages is named there, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
FOLDERS = ("coder_chat", "blocks", "flows", "prefect_coder")


def _tree() -> list[Path]:
    found = []
    for folder in FOLDERS:
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if any((base / up).is_symlink() for up in rel.parents):
                continue  # prefect_coder/flows -> ../flows: read as its own folder
            found.append(path)
    return found


def _drawn() -> str:
    # Only the drawings (code blocks): a name in the prose is not a room on the plan.
    return "\n".join(re.findall(r"```\n(.*?)```", DOC.read_text(), re.S))


def test_every_package_and_module_is_drawn() -> None:
    drawn = _drawn()
    words = set(re.findall(r"[\w.]+", drawn))
    missing = []
    for path in _tree():
        if path.name == "__init__.py":
            if path.parent.name not in {f.rstrip("/") for f in re.findall(r"\b\w+/", drawn)}:
                missing.append(f"{path.parent.relative_to(ROOT)}/")
        elif path.name not in words:
            missing.append(str(path.relative_to(ROOT)))
    assert len(_tree()) > 150  # the scan sees the tree
    assert not missing, "docs/architecture.md does not draw: " + ", ".join(missing)


def test_every_drawn_file_exists() -> None:
    names = {p.name for p in _tree()}
    drawn = set(re.findall(r"\b(\w+\.py)\b", _drawn()))
    assert drawn, "no module named in the drawings"
    gone = sorted(drawn - names)
    assert not gone, f"docs/architecture.md draws files that do not exist: {gone}"

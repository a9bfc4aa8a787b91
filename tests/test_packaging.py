"""The wheel users install: typed (PEP 561) and complete.

Built with ``pip wheel`` exactly as a user's installer would (build isolation: the
build backend pyproject.toml names), then read as a zip.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Source folder → the package it installs as (pyproject's package-dir).
INSTALLED_AS = {
    "coder_chat": "coder_chat",
    "prefect_coder": "prefect_coder",
    "flows": "prefect_coder/flows",
    "blocks": "prefect_coder/blocks",
}


def test_the_wheel_is_typed_and_holds_every_package(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("prefect_coder-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "coder_chat/py.typed" in names
    assert "prefect_coder/py.typed" in names
    # Every package of the source tree is in the wheel: a room missing from
    # pyproject's package list would import in the editable checkout and fail
    # for every user.
    missing = []
    for folder, installed in INSTALLED_AS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.relative_to(ROOT / folder)
            if any(p.is_symlink() for p in [ROOT / folder / q for q in rel.parents]):
                continue
            target = f"{installed}/{rel.as_posix()}"
            if target not in names:
                missing.append(target)
    assert not missing, (
        f"packages not in the wheel (pyproject [tool.setuptools] packages): {missing}"
    )

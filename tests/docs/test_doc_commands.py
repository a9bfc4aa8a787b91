"""The set-up commands of the README and docs/deploy.md work as written.

Every shell command of those pages that can run offline — registering the block
types, creating the pool, deploying, applying the automations — is read out of
their ``bash`` blocks and run, exactly as printed, by ``bash`` against a Prefect
server of its own (``scratch_prefect_server``), with the virtualenv's console
scripts on ``PATH`` as an installed user has them. A command that is not the
repository-root ``prefect deploy`` runs from a directory outside the checkout (a
module name that only resolves inside it, like ``-m blocks``, fails there as it
does for a user). Then the server is asked what the commands made.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "deploy.md"]

#: Commands that need nothing but a Prefect server (first words after any VAR=value).
OFFLINE = (
    ("prefect", "block", "register"),
    ("prefect", "work-pool", "create"),
    ("prefect", "--no-prompt", "deploy"),
    ("prefect", "deploy"),
    ("prefect-coder", "automations", "apply"),
)


def _words(line: str) -> list[str]:
    words = line.split("#", 1)[0].split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def offline_commands() -> list[tuple[str, str]]:
    """(page, command line) for every offline command in the pages' ``bash`` blocks."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.splitlines():
                words = _words(line)
                if any(tuple(words[: len(p)]) == p for p in OFFLINE):
                    found.append((page.name, line.split("#", 1)[0].strip()))
    return found


def test_the_pages_hold_the_set_up_commands() -> None:
    kinds = {tuple(_words(c)[:2]) for _, c in offline_commands()}
    # Guards against a scan that sees nothing, or a page that lost a step.
    assert ("prefect", "block") in kinds
    assert ("prefect", "work-pool") in kinds
    assert ("prefect", "--no-prompt") in kinds or ("prefect", "deploy") in kinds
    assert ("prefect-coder", "automations") in kinds


def test_the_offline_commands_run_as_written(scratch_prefect_server: str, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PREFECT_API_URL": scratch_prefect_server,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    ran = []
    for page, command in offline_commands():
        deploy = "deploy" in _words(command)
        cwd = ROOT if deploy else outside
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env={**env, "PWD": str(cwd)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        ran.append(command)
        assert done.returncode == 0, (
            f"{page}: `{command}` (in {cwd}) exited {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )

    # What the commands made, read back from the server.
    with httpx.Client(base_url=scratch_prefect_server, timeout=30) as api:
        types = {t["slug"] for t in api.post("/block_types/filter", json={}).json()}
        assert {"coder-credentials", "chat-state-store"} <= types, types
        pool = api.get("/work_pools/coder-process")
        assert pool.status_code == 200 and pool.json()["type"] == "process"
        expected = {
            d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
        }
        made = {d["name"] for d in api.post("/deployments/filter", json={}).json()}
        assert expected <= made, f"not deployed: {sorted(expected - made)}"
        automations = [a["name"] for a in api.post("/automations/filter", json={}).json()]
        assert any("heartbeats stopped" in name for name in automations), automations
    assert ran


@pytest.mark.parametrize("bad", ["prefect block register -m blocks"])
def test_the_old_block_register_line_fails_outside_the_checkout(bad: str, tmp_path: Path) -> None:
    # Why the docs name the installed package: outside the repository `blocks` is
    # nothing (it only resolved from the checkout's root by accident). No server needed:
    # the import fails first.
    done = subprocess.run(
        [sys.executable, "-c", "import importlib; importlib.import_module('blocks')"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "No module named 'blocks'" in done.stderr
    assert bad not in "\n".join(c for _, c in offline_commands())

"""Shared start-up of the examples: the right interpreter and the right Prefect server.

Imported first, before anything from the project or Prefect:

* :func:`require_project` stops with the command to use when the project is not
  importable (a plain ``python`` instead of the virtualenv's).
* :func:`use_prefect_server` picks the Prefect server: ``PREFECT_API_URL`` when
  set; else the server of a running ``scripts/demo`` (``.prefect-coder/``); else
  Prefect's temporary local server, with ``PREFECT_HOME`` in a temp dir and a
  start-up timeout long enough for a busy machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
import urllib.request
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def require_project(script: str) -> None:
    """Exit with the right command unless ``coder_chat`` and ``prefect_coder`` are
    installed. Looked up, not imported: Prefect reads its settings when first
    imported, so :func:`use_prefect_server` must run before any import of it."""
    missing = [name for name in ("coder_chat", "prefect_coder") if find_spec(name) is None]
    if missing:
        rel = Path(script).resolve()
        rel_text = str(rel.relative_to(ROOT)) if rel.is_relative_to(ROOT) else script
        sys.exit(
            f"No module named {missing[0]!r}: run the examples with the project's "
            f"virtualenv, from {ROOT}:\n"
            f"    .venv/bin/python {rel_text}\n"
            "(scripts/demo or scripts/test creates .venv/ and installs the project)"
        )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return bool(response.status == 200)
    except Exception:
        return False


def use_prefect_server(startup_timeout: int = 180) -> str:
    """Set the Prefect environment of this process; returns a line saying which server."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("PREFECT_API_URL"):
        return f"Prefect server: {os.environ['PREFECT_API_URL']} (PREFECT_API_URL)"
    port = os.environ.get("PREFECT_CODER_DEMO_PORT", "4242")
    demo_api = f"http://127.0.0.1:{port}/api"
    if (ROOT / ".prefect-coder" / "server.pid").exists() and _answers(f"{demo_api}/health"):
        os.environ["PREFECT_API_URL"] = demo_api
        os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect-coder" / "prefect"))
        return f"Prefect server: scripts/demo's, UI at {demo_api.removesuffix('/api')}"
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect-coder-example-"))
    # The temporary server migrates a fresh database first: ~10 s idle, much more on a
    # loaded machine (Prefect's default is 20 s).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(startup_timeout))
    return "Prefect server: a temporary local one (start scripts/demo for one with a UI)"

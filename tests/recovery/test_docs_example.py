"""docs/durable-workflows.md's runnable example runs, and shows what it claims.

The example runs as ``python -c <block>`` in a process of its own: forked from the
session's warm process when that is already up (``tests/warm_python.py``: the
example's ``import`` lines then find Prefect and this project imported, ≈ 3 CPU-s
less; its code still runs as ``__main__`` of a fresh process, with its own
globals), else a fresh interpreter. Starting the warm process (and the Prefect
server it needs) only for this would cost far more than it saves.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from recovery_env import ROOT
from warm_python import SOCKET_ENV

DOC = ROOT / "docs" / "durable-workflows.md"


def _runnable_block() -> str:
    text = DOC.read_text()
    start = text.index("<!-- runnable:")
    body = text[text.index("```python\n", start) + len("```python\n") :]
    return body[: body.index("\n```")]


async def _run(request: pytest.FixtureRequest, code: str) -> tuple[int, str, str]:
    """``python -c code`` in ROOT: its exit status, stdout and stderr."""
    if os.environ.get(SOCKET_ENV):  # the session's warm process is up
        warm = request.getfixturevalue("warm_python")
        child = await asyncio.to_thread(warm.start, ["-c", code], env=dict(warm.env), cwd=ROOT)
        done = await child.communicate(60)
        return done.returncode, done.stdout, done.stderr
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_runnable_example_recovers_without_a_second_effect(
    request: pytest.FixtureRequest,
) -> None:
    rc, text, err = await _run(request, _runnable_block())
    assert rc == 0, err[-3000:]
    assert "recovered" in text, text
    assert "requests: 2 distinct keys: 1" in text, text
    assert "redrive" in text, text

"""docs/durable-workflows.md's runnable example runs, and shows what it claims."""

from __future__ import annotations

import asyncio
import sys

from recovery_env import ROOT

DOC = ROOT / "docs" / "durable-workflows.md"


def _runnable_block() -> str:
    text = DOC.read_text()
    start = text.index("<!-- runnable:")
    body = text[text.index("```python\n", start) + len("```python\n") :]
    return body[: body.index("\n```")]


async def test_the_runnable_example_recovers_without_a_second_effect() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _runnable_block(),
        cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "recovered" in text, text
    assert "requests: 2 distinct keys: 1" in text, text
    assert "redrive" in text, text

"""A worker freezes its start-up heap once (``resources.freeze_startup_heap``, round 8
of docs/performance.md): full collections then skip the millions of objects the
imports left, which cost a fan-out worker ≈ 1 s of loop per full collection.

In a child process: freezing is process-wide, and this test process's heap is not
the test's to freeze.
"""

from __future__ import annotations

import os
import subprocess
import sys

from prefect_coder.flows.common.resources import FREEZE_ENV

_CHILD = """
import gc, os
from prefect_coder.flows.common import resources
os.environ[resources.FREEZE_ENV] = "0"
assert resources.freeze_startup_heap() is False and gc.get_freeze_count() == 0
del os.environ[resources.FREEZE_ENV]
assert resources.freeze_startup_heap() is True
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen  # the imports' objects, not a handful
assert resources.freeze_startup_heap() is False  # once per process
junk = [[] for _ in range(1000)]
assert gc.get_freeze_count() == frozen  # later objects stay collectable
print("ok")
"""


def test_the_startup_heap_is_frozen_once_per_process_unless_turned_off() -> None:
    env = {k: v for k, v in os.environ.items() if k != FREEZE_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"

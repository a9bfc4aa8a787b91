"""Fixtures of the chaos test: the crash machinery of ``tests/recovery`` (fork
server, payments service, ``charge_card`` tool) imported from there, on an
emulator, payments service and blocks of this directory's own (a schedule arms
global faults and restarts the emulator, so it shares them with no other test).
The Prefect server is the session's (``tests/conftest.py``).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from warm_python import WarmPython

HERE = Path(__file__).resolve().parent
RECOVERY = HERE.parent / "recovery"
FAULTS = HERE.parent / "faults"  # the dependency faults' helpers (chaos_infra)
for _p in (str(HERE), str(RECOVERY), str(FAULTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from chaos_runner import Rig, open_rig, process_env  # noqa: E402
from payments import running_payments  # noqa: E402
from recovery_env import PrefectEnv  # noqa: E402


@pytest.fixture(scope="module")
async def rig(
    prefect_harness: Any, warm_python: WarmPython, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Rig]:
    env = PrefectEnv(prefect_harness.api_url, prefect_harness.results_dir)
    workdir = tmp_path_factory.mktemp("chaos")
    with running_payments() as payments, process_env(payments):
        # The crash children fork from the session's warm process (no Prefect import
        # of a warm process of the rig's own).
        async with open_rig(env.child_env(), workdir, payments, warm_python) as r:
            yield r

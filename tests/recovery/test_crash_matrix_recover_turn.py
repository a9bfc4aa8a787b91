"""The crash matrix, recovered by the ``recover-turn`` flow followed by the rerun
(which then returns every step from storage): a real SIGKILL of the process running
the step, at every named point (``crash_matrix.CASES``). ``test_crash_matrix.py`` is
the same matrix recovered by a plain rerun (a file per mode: under ``--dist
loadfile`` the two batches run on two xdist workers side by side).

After recovery: the invariants of ``crash_matrix.check`` (each payment effect once
per key, one key per step, the fault-free run's results, extra user turns only where
the documented window allows, nothing live).
"""

from __future__ import annotations

from typing import Any

import pytest
from crash_matrix import CASES, Case, ForkServer, check, crash_rows, recover_rows
from payments import Payments
from recovery_env import PrefectEnv

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings

MODES = ["recover-turn"]


@pytest.fixture(scope="module")
async def crashed(
    matrix_settings: WorkflowSettings,
    prefect_env: PrefectEnv,
    payments: Payments,
    emu: Emulator,
    baseline: list[str],
    fork_server: ForkServer,
) -> dict[tuple[str, str], str]:
    """Every row of this mode crashed once (``crash_matrix.crash_rows``)."""
    return await crash_rows(MODES, matrix_settings, fork_server, emu)


@pytest.fixture(scope="module")
async def recovered(
    crashed: dict[tuple[str, str], str], matrix_settings: WorkflowSettings
) -> dict[tuple[str, str], list[Any] | BaseException]:
    """Every crashed row recovered, concurrently (``crash_matrix.recover_rows``)."""
    return await recover_rows(crashed, matrix_settings)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("mode", MODES)
async def test_crash_matrix(
    case: Case,
    mode: str,
    crashed: dict[tuple[str, str], str],
    recovered: dict[tuple[str, str], list[Any] | BaseException],
    baseline: list[str],
    payments: Payments,
    emu: Emulator,
) -> None:
    results = recovered[case.name, mode]
    if isinstance(results, BaseException):
        raise results
    await check(case, crashed[case.name, mode], results, baseline, payments, emu)

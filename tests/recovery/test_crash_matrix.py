"""The crash matrix, recovered by a plain rerun (automatic): a real SIGKILL of the
process running the step, at every named point (``crash_matrix.CASES``), then the
workflow run again. ``test_crash_matrix_recover_turn.py`` is the same matrix
recovered by the ``recover-turn`` flow (a file per mode: under ``--dist loadfile``
the two batches run on two xdist workers side by side).

After recovery: each payment effect applied exactly once per idempotency key and
one key per step; the final results equal the fault-free run's; at most one extra
user turn, only where the documented window allows it, with the same marker; no
chat of the workflow left in ``requires_action`` or running.
"""

from __future__ import annotations

from typing import Any

import pytest
from crash_matrix import CASES, Case, ForkServer, check, crash_rows, recover_rows
from payments import Payments
from recovery_env import PrefectEnv

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings

MODES = ["rerun"]


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

"""Randomized chaos (issue 11): seeded schedules mixing real SIGKILLs at crash
points, stream drops, REST faults, emulator restarts and sweeps racing recovery,
then recovery to the end; every invariant of ``chaos_invariants`` must hold.

A short fixed seed set; ``bench/chaos.py`` runs hundreds (docs/chaos.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos_runner import Rig, run_schedule
from chaos_schedule import make_schedule

#: Short schedules that cover, between them, kills in both steps and both recovery
#: modes, a followed continuation, lost responses, 5xx on sends and interrupts,
#: dropped/closed streams, refused upgrades, an emulator restart and both sweeps
#: racing recovery (bench/chaos.py runs hundreds; docs/chaos.md).
SEEDS: list[Any] = [
    1,
    4,
    7,
    8,
    # Real bugs the chaos run found (docs/chaos.md, "Findings"), fixed: a lost
    # POST /tool-results response during a live continuation.
    44,
    # Fixed too, but its schedule also races sweep-stuck-turns (0.01 s budgets)
    # against the rerun, and a sweep that cuts short a pause whose call never ran
    # makes the rerun resubmit the step — its earlier charge then runs again (the
    # open finding of seeds 14 and 71; 1 failure in 19 replays of 61). Not strict:
    # a pass is the usual outcome and is reported as XPASS.
    pytest.param(
        61,
        marks=pytest.mark.xfail(
            strict=False,
            reason="open: sweep-stuck-turns cuts short a pause recovery would answer "
            "(docs/chaos.md Findings, seeds 14/71); fails about 1 in 19 replays",
        ),
    ),
]


@pytest.mark.parametrize("seed", SEEDS)
async def test_chaos_schedule_keeps_every_invariant(seed: int, rig: Rig) -> None:
    outcome = await run_schedule(rig, make_schedule(seed))
    print(outcome.report())
    assert outcome.ok, "\n" + outcome.report()

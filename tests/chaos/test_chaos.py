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
    # Real bugs the chaos run found (docs/chaos.md, "Findings"): kept as strict
    # xfails until fixed, then plain seeds.
    pytest.param(
        44,
        marks=pytest.mark.xfail(
            strict=True,
            reason="a lost POST /tool-results response during a long continuation: "
            "recovery interrupts the live attempt and resubmits, the model charges "
            "again under a new tool-call id (issue 11 item 1 via a transient failure)",
        ),
    ),
    pytest.param(
        61,
        marks=pytest.mark.xfail(
            strict=True,
            reason="a run failing on a lost POST /tool-results response leaves its "
            "continuation interrupted; the rerun returns the cut-short attempt "
            "(text '') as the step's answer and the second charge never runs "
            "(issue 11 item 6: an interrupt not journaled as cut-short)",
        ),
    ),
]


@pytest.mark.parametrize("seed", SEEDS)
async def test_chaos_schedule_keeps_every_invariant(seed: int, rig: Rig) -> None:
    outcome = await run_schedule(rig, make_schedule(seed))
    print(outcome.report())
    assert outcome.ok, "\n" + outcome.report()

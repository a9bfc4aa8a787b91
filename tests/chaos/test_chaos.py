"""Randomized chaos (issue 11): seeded schedules mixing real SIGKILLs at crash
points, stream drops, REST faults, emulator restarts and sweeps racing recovery,
then recovery to the end; every invariant of ``chaos_invariants`` must hold.

A short fixed seed set; ``bench/chaos.py`` runs hundreds (docs/chaos.md).
"""

from __future__ import annotations

import pytest
from chaos_runner import Rig, run_schedule
from chaos_schedule import make_schedule

#: Chosen to cover, between them, every kind of event (see docs/chaos.md).
SEEDS = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("seed", SEEDS)
async def test_chaos_schedule_keeps_every_invariant(seed: int, rig: Rig) -> None:
    outcome = await run_schedule(rig, make_schedule(seed))
    print(outcome.report())
    assert outcome.ok, "\n" + outcome.report()

"""The schedule generator (pure): a seed is the same schedule every time, and each
lifecycle dimension of issue 29 has the shape the runner relies on, and the
dependency faults of issue 30 fit the store and leave the other draws alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from chaos_schedule import (
    ANSWERED_POINT,
    APPROVAL_POINTS,
    FIRST_STEP_POINTS,
    INFRA_FAULTS,
    LIFECYCLES,
    RECOVERY_RUN_POINTS,
    RESUMED_POINTS,
    SHORT_STORE_WAIT,
    START_POINT,
    Schedule,
    Timed,
    make_schedule,
)

SEEDS = range(1, 301)


def test_a_seed_is_the_same_schedule_every_time() -> None:
    for seed in (1, 7, 44, 250):
        assert make_schedule(seed) == make_schedule(seed)
        assert make_schedule(seed).describe() == make_schedule(seed).describe()


def test_the_lifecycle_draw_leaves_the_base_events_alone() -> None:
    """A seed drawn without a lifecycle is exactly its schedule forced to none (the
    schedule it had before issue 29): the dimension is drawn from its own stream."""
    plain = [s for s in SEEDS if make_schedule(s).lifecycle == ""]
    assert plain
    for seed in plain:
        assert make_schedule(seed) == make_schedule(seed, "")
    for seed in SEEDS:
        base, drawn = make_schedule(seed, ""), make_schedule(seed)
        assert base.templates == drawn.templates and base.retries == drawn.retries


def test_every_dimension_is_drawn_often_in_a_long_run() -> None:
    seen = Counter(make_schedule(s).lifecycle for s in SEEDS)
    assert set(seen) == set(LIFECYCLES)
    assert all(n >= 25 for n in seen.values()), seen
    with pytest.raises(ValueError):
        make_schedule(1, "bogus")


def _of(lifecycle: str) -> list[Schedule]:
    return [make_schedule(s, lifecycle) for s in SEEDS if make_schedule(s).lifecycle == lifecycle]


def test_start_kills_the_first_run_at_its_start() -> None:
    for sch in _of("start"):
        children = [p for p in sch.phases if p.kind == "child"]
        assert children[0].crash_at == START_POINT
        assert sch.phases[-1].kind == "recover"
    # sometimes a rerun is killed at its start too
    assert any(sum(p.crash_at == START_POINT for p in sch.phases) >= 2 for sch in _of("start"))


def test_recovery_runs_are_recover_turn_children_killed_after_a_first_kill() -> None:
    counts: Counter[int] = Counter()
    for sch in _of("recovery-run"):
        kinds = [(p.kind, p.flow) for p in sch.phases]
        runs = [p for p in sch.phases if p.kind == "child" and p.flow == "recover-turn"]
        assert 1 <= len(runs) <= 2
        counts[len(runs)] += 1
        assert all(p.crash_at in RECOVERY_RUN_POINTS for p in runs)
        # one workflow run, killed in its first step, then only recover-turn runs
        assert sch.phases[0].flow == "agent-workflow"
        assert sch.phases[0].crash_at in FIRST_STEP_POINTS
        assert kinds[1:-1] == [("child", "recover-turn")] * len(runs)
        assert sch.phases[-1].kind == "recover"
    assert counts[1] and counts[2]  # twice in a row occurs


def test_shard_runs_every_child_as_a_shard() -> None:
    modes = set()
    for sch in _of("shard"):
        assert all(p.flow == "shard" for p in sch.phases if p.kind == "child")
        modes.add(sch.phases[-1].mode)
    assert "shard" in modes and modes - {"shard"}


def test_approval_runs_deployment_runs_then_a_decision() -> None:
    second = 0
    for sch in _of("approval"):
        assert sch.approval and "(approve)" in sch.describe()
        kinds = [p.kind for p in sch.phases]
        assert kinds[-2:] == ["decide", "recover"]
        runs = sch.phases[:-2]
        assert 1 <= len(runs) <= 2
        assert all(p.kind == "child" and p.flow == "deployment" for p in runs)
        assert runs[0].crash_at in APPROVAL_POINTS
        assert sch.phases[-2].crash_at in RESUMED_POINTS
        second += len(runs) == 2
    assert second  # a second run started beside the first occurs
    points = {make_schedule(s, "approval").phases[0].crash_at for s in SEEDS}
    assert {"", "approval.before_suspend:1", "approval.suspended:1", START_POINT} <= points


def _infra(sch: Schedule) -> list[Timed]:
    return [t for p in sch.phases for t in p.timed if t.infra]


def test_dependency_faults_leave_the_other_draws_alone() -> None:
    """With a store named, a seed keeps every other event it had (issue 30: the
    dependency faults come from a stream of their own) and only gains timed faults."""
    for seed in SEEDS:
        base = make_schedule(seed)
        for store in INFRA_FAULTS:
            sch = make_schedule(seed, store=store, prefect_restart=True)
            assert (sch.templates, sch.retries, sch.lifecycle) == (
                base.templates,
                base.retries,
                base.lifecycle,
            )
            assert len(sch.phases) == len(base.phases)
            for p, q in zip(sch.phases, base.phases, strict=True):
                assert [t for t in p.timed if not t.infra] == list(q.timed)
                if p.crash_at != q.crash_at:  # the one other change: seed 263's window
                    assert p.kind == "decide" and p.crash_at == ANSWERED_POINT, p
                assert replace(p, timed=q.timed, crash_at=q.crash_at) == q
        assert not _infra(base)


def test_dependency_faults_fit_the_store_and_the_server() -> None:
    drawn: dict[str, Counter[str]] = {}
    for store, kinds in INFRA_FAULTS.items():
        seen: Counter[str] = Counter()
        for seed in SEEDS:
            for t in _infra(make_schedule(seed, store=store, prefect_restart=True)):
                assert t.action in kinds and t.downtime in kinds[t.action][1], t
                seen[t.action] += 1
            no_restart = make_schedule(seed, store=store, prefect_restart=False)
            assert all(t.action != "prefect-restart" for t in _infra(no_restart))
        assert set(seen) == set(kinds), seen  # every kind occurs in a long run
        drawn[store] = seen
    assert "store-lock" not in drawn["pg"] and "store-restart" not in drawn["sqlite"]
    with_faults = sum(bool(_infra(make_schedule(s, store="pg"))) for s in SEEDS)
    assert 0.45 * len(SEEDS) < with_faults < 0.75 * len(SEEDS), with_faults
    with pytest.raises(ValueError):
        make_schedule(1, store="mysql")


def test_half_the_faulted_schedules_give_the_store_little_patience() -> None:
    """``store_wait`` (the store block's timeouts) is short only beside a dependency
    fault, about half the time; never without a store named."""
    faulted = [
        sch for s in SEEDS if _infra(sch := make_schedule(s, store="pg", prefect_restart=True))
    ]
    short = [sch for sch in faulted if sch.store_wait == SHORT_STORE_WAIT]
    assert 0.3 * len(faulted) < len(short) < 0.7 * len(faulted), (len(short), len(faulted))
    for seed in SEEDS:
        sch = make_schedule(seed, store="sqlite")
        assert sch.store_wait in (None, SHORT_STORE_WAIT)
        assert sch.store_wait is None or _infra(sch)
        assert make_schedule(seed).store_wait is None
    assert "store waits 2+3 s" in short[0].describe()


def test_a_resumed_run_is_killed_before_it_records_the_answer_only_with_a_store() -> None:
    """Seed 263's window (the answer read, not yet recorded) is drawn for about a
    quarter of the approval schedules when a store is named, never without one."""
    approval = [s for s in SEEDS if make_schedule(s).lifecycle == "approval"]
    answered = [
        s
        for s in approval
        if any(p.crash_at == ANSWERED_POINT for p in make_schedule(s, store="sqlite").phases)
    ]
    assert 0.1 * len(approval) < len(answered) < 0.45 * len(approval), answered
    for seed in SEEDS:
        assert all(p.crash_at != ANSWERED_POINT for p in make_schedule(seed).phases)

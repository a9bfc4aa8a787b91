"""How ``agent-fanout`` cuts its workflows into shards and keys their runs (pure rules;
the shards' real runs on process workers are in test_fanout_workers.py)."""

from __future__ import annotations

from prefect_coder.flows.common.params import Step
from prefect_coder.flows.deployments.agent_fanout import (
    FanoutItem,
    cut_shards,
    shard_idempotency_key,
)


def _items(n: int) -> list[FanoutItem]:
    return [FanoutItem(workflow_id=f"w{i}", steps=[Step(name="s", prompt="p")]) for i in range(n)]


def test_shards_keep_order_and_split_max_parallel() -> None:
    shards, per_shard, at_once = cut_shards(_items(45), 20, 64)
    assert [[w.workflow_id for w in s] for s in shards] == [
        [f"w{i}" for i in range(0, 20)],
        [f"w{i}" for i in range(20, 40)],
        [f"w{i}" for i in range(40, 45)],
    ]
    assert (per_shard, at_once) == (20, 3)
    # max_parallel below the shard size: one shard at a time, max_parallel inside it.
    assert cut_shards(_items(45), 20, 8)[1:] == (8, 1)
    assert len(cut_shards(_items(3), 1, 2)[0]) == 3


def test_shard_key_is_stable_and_names_its_workflows() -> None:
    a = [f"w{i}" for i in range(20)]
    assert shard_idempotency_key(a) == shard_idempotency_key(list(a))
    assert shard_idempotency_key(a) != shard_idempotency_key(a[:-1])
    assert shard_idempotency_key(a) != shard_idempotency_key(list(reversed(a)))
    # a restart after a crashed run is keyed by that run, stable too
    after = shard_idempotency_key(a, "run-1")
    assert after == shard_idempotency_key(a, "run-1") != shard_idempotency_key(a)
    assert after.startswith(shard_idempotency_key(a))

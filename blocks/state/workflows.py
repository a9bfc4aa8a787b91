"""Workflows: a durable record of every workflow run the product starts (issue 29).

``reconcile-workflows`` (``prefect_coder.flows.liveness``) drives every record still
``running`` to an end: it needs, from durable state alone, what to rerun (the
deployment and ALL the run's parameters), which Prefect flow run is the current one,
which leases show that run alive, and how many recoveries it already started. A
record is written where a run starts (the workflow lease, the fan-out and shard
entrypoints), ``done`` at a clean end (or when the reconciler sees the run Completed),
``gave-up`` when its recoveries are exhausted.

Parameters hold block names, never a token: :meth:`Workflows.started` refuses
anything that is not plain JSON, so a ``SecretStr`` cannot be written by accident.
Times are epoch seconds of the database clock, like every time the store stamps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from ._ops import Ops
from .engines import upsert
from .schema import checkpoints as cp
from .schema import leases as lt
from .schema import workflows as t

__all__ = ["LeaseView", "WorkflowRecord", "WorkflowState", "Workflows", "WorkflowsSnapshot"]

WorkflowState = Literal["running", "done", "gave-up"]


#: The reason of a record whose run failed resumably (``Workflows.resumable``).
RESUMABLE_PREFIX = "resumable: "


class WorkflowRecord(BaseModel):
    """One tracked workflow run (see the module docstring); times: store-clock epoch s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    deployment: str
    parameters: dict[str, Any]
    workflow_id: str | None = None
    #: The workflow's checkpointed chat, when one exists (joined from the checkpoints).
    chat_id: str | None = None
    flow_run_id: str | None = None
    lease_keys: tuple[str, ...] = ()
    attempts: int = 0
    state: WorkflowState = "running"
    reason: str | None = None
    acted_at: float | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


class LeaseView(BaseModel):
    """A lease row as the reconciler sees it (released rows have ``expires_at`` 0)."""

    model_config = ConfigDict(frozen=True)

    key: str
    holder: str
    acquired_at: float
    expires_at: float


class WorkflowsSnapshot(BaseModel):
    """Every unfinished record, the lease rows they name and the store clock, read in
    ONE transaction (so the ages compare on one clock)."""

    model_config = ConfigDict(frozen=True)

    now: float
    records: list[WorkflowRecord]
    leases: dict[str, LeaseView]


def _dumps(parameters: dict[str, Any]) -> str:
    try:
        return json.dumps(parameters, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # Only the type: the value could be a secret.
        raise ValueError(
            f"parameters: must be plain JSON (block names, never a token): {type(exc).__name__}"
        ) from None


def _record(row: Any, chat_id: str | None = None) -> WorkflowRecord:
    return WorkflowRecord(
        key=row.key,
        deployment=row.deployment,
        parameters=json.loads(row.parameters_json),
        workflow_id=row.workflow_id,
        chat_id=chat_id,
        flow_run_id=row.flow_run_id,
        lease_keys=tuple(json.loads(row.lease_keys_json)),
        attempts=row.attempts,
        state=row.state,
        reason=row.reason,
        acted_at=row.acted_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


class Workflows:
    """``store.workflows``: started / finished / snapshot / claim_attempt / give_up."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    def _ours(self, key: str) -> sa.ColumnElement[bool]:
        return sa.and_(t.c.tenant == self._ops.tenant, t.c.key == key)

    async def started(
        self,
        key: str,
        *,
        deployment: str,
        parameters: dict[str, Any],
        flow_run_id: str | None,
        workflow_id: str | None = None,
        lease_keys: Sequence[str] = (),
    ) -> WorkflowRecord:
        """Record (idempotently) that ``flow_run_id`` of ``deployment`` runs ``key``.

        A record still ``running`` keeps its ``attempts`` (this is the reconciler's own
        rerun, or a rerun by hand or by a trigger, of an unfinished workflow); one that
        had ended starts afresh at 0.
        """
        if not key or not deployment:
            raise ValueError("key and deployment: required")
        now = self._ops.now()
        stmt = upsert(self._ops.backend, t).values(
            tenant=self._ops.tenant,
            key=key,
            deployment=deployment,
            parameters_json=_dumps(parameters),
            workflow_id=workflow_id,
            flow_run_id=flow_run_id,
            lease_keys_json=json.dumps(list(lease_keys)),
            attempts=0,
            state="running",
            reason=None,
            acted_at=None,
            created_at=now,
            updated_at=now,
        )
        running = t.c.state == "running"
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.c.tenant, t.c.key],
            set_={
                "deployment": stmt.excluded.deployment,
                "parameters_json": stmt.excluded.parameters_json,
                "workflow_id": stmt.excluded.workflow_id,
                "flow_run_id": stmt.excluded.flow_run_id,
                "lease_keys_json": stmt.excluded.lease_keys_json,
                "attempts": sa.case((running, t.c.attempts), else_=0),
                "acted_at": sa.case((running, t.c.acted_at), else_=None),
                "reason": sa.case((running, t.c.reason), else_=None),
                "state": "running",
                "updated_at": stmt.excluded.updated_at,
            },
        ).returning(*t.c)
        async with self._ops.write() as conn:
            return _record((await conn.execute(stmt)).one())

    async def finished(
        self,
        key: str,
        *,
        flow_run_id: str | None,
        state: WorkflowState = "done",
        reason: str | None = None,
    ) -> bool:
        """Mark ``key`` ended — only while ``flow_run_id`` is still its current run and it
        is ``running`` (a stale run never ends a newer run's record). True if changed."""
        cond = [self._ours(key), t.c.state == "running"]
        if flow_run_id is not None:
            cond.append(t.c.flow_run_id == flow_run_id)
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.update(t)
                .where(*cond)
                .values(state=state, reason=reason, updated_at=self._ops.now())
                .returning(t.c.key)
            )
            return res.first() is not None

    def _with_chat(self) -> sa.Select[Any]:
        # The workflow's checkpointed chat, joined (a record never stores it: the
        # checkpoint is the one place a workflow's chat is written).
        return sa.select(t, cp.c.chat_id.label("cp_chat_id")).select_from(
            t.outerjoin(cp, sa.and_(cp.c.tenant == t.c.tenant, cp.c.workflow_id == t.c.workflow_id))
        )

    async def get(self, key: str) -> WorkflowRecord | None:
        """The record of ``key`` (any state), with its chat, or None."""
        async with self._ops.read() as conn:
            row = (await conn.execute(self._with_chat().where(self._ours(key)))).one_or_none()
        return None if row is None else _record(row, row.cp_chat_id)

    async def list(self, state: WorkflowState | None = None) -> list[WorkflowRecord]:
        """Every record of this tenant (optionally in one state), with its chat, by key."""
        q = self._with_chat().where(t.c.tenant == self._ops.tenant)
        if state is not None:
            q = q.where(t.c.state == state)
        async with self._ops.read() as conn:
            rows = (await conn.execute(q.order_by(t.c.key))).all()
        return [_record(r, r.cp_chat_id) for r in rows]

    async def snapshot(self, limit: int = 10_000) -> WorkflowsSnapshot:
        """The unfinished records (with their workflow's checkpointed chat), the lease
        rows they name, and the store clock — three reads in one transaction."""
        tenant = self._ops.tenant
        q = (
            self._with_chat()
            .where(t.c.tenant == tenant, t.c.state == "running")
            .order_by(t.c.updated_at)
            .limit(limit)
        )
        async with self._ops.read() as conn:
            now = float((await conn.execute(sa.select(self._ops.now()))).scalar_one())
            rows = (await conn.execute(q)).all()
            records = [_record(r, r.cp_chat_id) for r in rows]
            keys = sorted({k for r in records for k in r.lease_keys})
            leases: dict[str, LeaseView] = {}
            for at in range(0, len(keys), 500):
                for row in (
                    await conn.execute(
                        sa.select(lt).where(
                            lt.c.tenant == tenant, lt.c.key.in_(keys[at : at + 500])
                        )
                    )
                ).all():
                    leases[row.key] = LeaseView(
                        key=row.key,
                        holder=row.holder,
                        acquired_at=row.acquired_at,
                        expires_at=row.expires_at,
                    )
        return WorkflowsSnapshot(now=now, records=records, leases=leases)

    async def claim_attempt(
        self, key: str, *, expected_attempts: int, flow_run_id: str | None, reason: str
    ) -> bool:
        """Compare-and-set: count one more recovery of ``key`` (now naming the rerun
        ``flow_run_id``) only if it still has ``expected_attempts`` and is running —
        of two reconcilers acting on one snapshot, one wins."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.update(t)
                .where(self._ours(key), t.c.state == "running", t.c.attempts == expected_attempts)
                .values(
                    attempts=expected_attempts + 1,
                    flow_run_id=sa.func.coalesce(flow_run_id, t.c.flow_run_id),
                    reason=reason,
                    acted_at=self._ops.now(),
                    updated_at=self._ops.now(),
                )
                .returning(t.c.key)
            )
            return res.first() is not None

    async def noted(self, key: str, reason: str) -> None:
        """Record an act that is not a recovery (a dead run marked Crashed): its time
        starts the backoff before the recovery that follows."""
        async with self._ops.write() as conn:
            await conn.execute(
                sa.update(t)
                .where(self._ours(key), t.c.state == "running")
                .values(reason=reason, acted_at=self._ops.now(), updated_at=self._ops.now())
            )

    async def resumable(self, key: str, *, flow_run_id: str, why: str) -> bool:
        """Mark that ``flow_run_id`` — still the record's run — failed in a way a rerun
        can continue (its chat was kept live): the reconciler reruns it. True if marked."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.update(t)
                .where(self._ours(key), t.c.state == "running", t.c.flow_run_id == flow_run_id)
                .values(
                    reason=f"{RESUMABLE_PREFIX}{why}",
                    acted_at=self._ops.now(),
                    updated_at=self._ops.now(),
                )
                .returning(t.c.key)
            )
            return res.first() is not None

    async def give_up(self, key: str, *, expected_attempts: int, reason: str) -> bool:
        """Compare-and-set ``running`` → ``gave-up``; True for the one caller that did it
        (it alone emits the event and the artifact)."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.update(t)
                .where(self._ours(key), t.c.state == "running", t.c.attempts == expected_attempts)
                .values(
                    state="gave-up",
                    reason=reason,
                    acted_at=self._ops.now(),
                    updated_at=self._ops.now(),
                )
                .returning(t.c.key)
            )
            return res.first() is not None

    async def forget(self, key: str) -> bool:
        """Delete a record (an operator's clean-up); True if it existed."""
        async with self._ops.write() as conn:
            res = await conn.execute(sa.delete(t).where(self._ours(key)).returning(t.c.key))
            return res.first() is not None

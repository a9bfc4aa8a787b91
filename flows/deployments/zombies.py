"""The zombie-run automation: a flow run whose heartbeats stopped is marked Crashed.

A lost host (the worker and its flow-run process killed together, a VM gone)
leaves its run ``Running`` for ever: nobody is left to report the crash, so the
``recover-turn`` triggers on ``prefect.flow-run.Crashed`` never fire. Prefect's
own answer (its docs: "detect and respond to zombie flows"): workers run flows
with ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` set, so each run emits
``prefect.flow-run.heartbeat`` every that many seconds, and an automation with a
*proactive* trigger marks a run Crashed when, after a heartbeat, neither another
heartbeat nor a final state arrived within ``within`` seconds. The Crashed state
it sets emits ``prefect.flow-run.Crashed``, and the existing triggers recover.

:func:`apply_zombie_automation` creates it, or updates it in place, by name
(idempotent: the deploy path runs it after every deploy). It is restricted to
this product's flows (related resource ``role: flow`` by name): heartbeats carry
the flow's name but not the deployment's. A run that suspends or pauses (an
approval) satisfies the trigger like a final state: it sends no heartbeats while it
waits for a person, and must never be crashed for that. This automation is the fast
path; ``reconcile-workflows`` (docs/reconciler.md) guarantees the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "MISSED_HEARTBEATS",
    "PRODUCT_FLOWS",
    "ZOMBIE_AUTOMATION",
    "AppliedAutomation",
    "apply_zombie_automation",
    "zombie_automation",
]

ZOMBIE_AUTOMATION = "prefect-coder: crash runs whose heartbeats stopped"
#: Seconds between flow-run heartbeats on the workers (Prefect's minimum is 30).
DEFAULT_HEARTBEAT_S = 30
#: Heartbeats a run may miss before it is declared Crashed: one late heartbeat on a
#: busy worker must not crash a live run (and fire a recovery beside it).
MISSED_HEARTBEATS = 3
#: The flows of this product's deployments (prefect.yaml).
PRODUCT_FLOWS = (
    "agent-workflow",
    "agent-turn",
    "agent-fanout",
    "agent-fanout-shard",
    "archive-workflow-chat",
    "expire-approvals",
    "reconcile-workflows",
    "recover-turn",
    "sweep-orphans",
    "sweep-stuck-turns",
)
_FINAL = ("Completed", "Failed", "Cancelled", "Crashed")
#: States a run enters on purpose and then sends no heartbeats in: waiting for a
#: person (``Suspended`` — its process exits — and ``Paused``, both of type PAUSED).
#: Without them in ``expect`` an approval was crashed ``within`` seconds after its
#: last heartbeat (issue 29): its deadline is the approval timeout, never a heartbeat.
_WAITING = ("Suspended", "Paused")


def zombie_automation(
    *,
    heartbeat_s: int = DEFAULT_HEARTBEAT_S,
    within_s: float | None = None,
    flows: tuple[str, ...] | list[str] = PRODUCT_FLOWS,
    name: str = ZOMBIE_AUTOMATION,
) -> Automation:
    """The automation (not saved): ``within_s`` defaults to ``MISSED_HEARTBEATS`` beats.

    Prefect accepts ``within`` ≥ 10 s for a proactive trigger; a ``within`` shorter
    than the heartbeat interval crashes live runs between two heartbeats (tests use
    it only on a run they killed).
    """
    if heartbeat_s < 30:
        raise ValueError("heartbeat_s: Prefect's minimum heartbeat interval is 30 seconds")
    within = float(within_s if within_s is not None else MISSED_HEARTBEATS * heartbeat_s)
    if not flows:
        raise ValueError("flows: name at least one flow (an empty list would match every run)")
    return Automation(
        name=name,
        description=(
            f"Marks a flow run of {', '.join(flows)} Crashed when {within:.0f}s passed after "
            "a heartbeat without another heartbeat or a final state (its host was lost), so "
            "the recover-turn triggers on Crashed recover it. Created by "
            "`prefect-coder automations apply`; see docs/deploy.md."
        ),
        enabled=True,
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(flows)},
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                *(f"prefect.flow-run.{s}" for s in (*_FINAL, *_WAITING)),
            },
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                name=None,
                force=False,
                message=(
                    f"No heartbeat for {within:.0f}s: the run's process or host was lost "
                    "(prefect-coder zombie automation)."
                ),
            )
        ],
    )


@dataclass(frozen=True, slots=True)
class AppliedAutomation:
    """What :func:`apply_zombie_automation` did: ``created``, ``updated`` or ``unchanged``."""

    action: str
    automation: Automation


def _comparable(a: Automation) -> dict[str, object]:
    # Python mode keeps the trigger's sets (``expect``, ``after``) as sets: JSON mode
    # turns them into lists in iteration order, which differs between the server's copy
    # and ours, and an unchanged automation then reads as "updated".
    return a.model_dump(
        mode="python", include={"name", "description", "enabled", "trigger", "actions"}
    )


async def apply_zombie_automation(
    *,
    heartbeat_s: int = DEFAULT_HEARTBEAT_S,
    within_s: float | None = None,
    flows: tuple[str, ...] | list[str] = PRODUCT_FLOWS,
    name: str = ZOMBIE_AUTOMATION,
) -> AppliedAutomation:
    """Create the zombie-run automation, or update the one with this name in place."""
    wanted = zombie_automation(heartbeat_s=heartbeat_s, within_s=within_s, flows=flows, name=name)
    try:
        existing = await Automation.aread(name=name)
    except ValueError:  # "Automation not found": read raises ValueError
        existing = None
    if existing is None:
        return AppliedAutomation("created", await wanted.acreate())
    if _comparable(existing) == _comparable(wanted):
        return AppliedAutomation("unchanged", existing)
    wanted.id = existing.id
    await wanted.aupdate()
    return AppliedAutomation("updated", wanted)

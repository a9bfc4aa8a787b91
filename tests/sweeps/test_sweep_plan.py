"""The sweeps' per-chat decisions (pure): which chats are orphans, the grace
period, stuck-turn budgets, and the paused/busy refinements."""

from __future__ import annotations

from prefect_coder.flows.common.labels import chat_labels
from prefect_coder.flows.sweeps.plan import (
    Accounting,
    Action,
    ChatFacts,
    busy_refinement,
    parse_time,
    paused_refinement,
    plan_orphan,
    plan_stuck,
)

NOW = 1_800_000_000.0
TENANT = "acme"


def chat(
    chat_id: str = "c1",
    *,
    status: str = "waiting",
    archived: bool = False,
    age: float | None = 3600.0,
    idle: float | None = 3600.0,
    labels: dict[str, str] | None = None,
) -> ChatFacts:
    return ChatFacts(
        chat_id=chat_id,
        status=status,
        archived=archived,
        created_at=None if age is None else NOW - age,
        updated_at=None if idle is None else NOW - idle,
        labels=chat_labels(TENANT, "wf-1") if labels is None else labels,
    )


def acct(**kw: object) -> Accounting:
    return Accounting(tenant=TENANT, **kw)  # type: ignore[arg-type]


def orphan(c: ChatFacts, a: Accounting | None = None, grace: float = 600.0) -> Action:
    return plan_orphan(c, a or acct(), now=NOW, grace_s=grace).action


def test_checkpointed_chats_are_kept_whatever_their_status_or_age() -> None:
    a = acct(checkpointed={"c1": "wf-1"})
    for status in ("waiting", "running", "requires_action", "error", "interrupting"):
        d = plan_orphan(chat(status=status, age=1e9), a, now=NOW, grace_s=0)
        assert d.action is Action.KEEP and "checkpointed by workflow wf-1" in d.reason


def test_unaccounted_chats_are_retired_whatever_their_status_once_past_grace() -> None:
    for status in ("waiting", "running", "requires_action", "error", "interrupting"):
        assert orphan(chat(status=status)) is Action.RETIRE


def test_a_live_first_turn_inside_the_grace_period_waits() -> None:
    d = plan_orphan(chat(status="running", age=30), acct(), now=NOW, grace_s=600)
    assert d.action is Action.WAIT and "grace" in d.reason
    assert orphan(chat(age=600), grace=600) is Action.RETIRE  # the boundary belongs to retire
    assert orphan(chat(age=None)) is Action.WAIT  # no age: cannot prove it is past the grace


def test_foreign_chats_are_ignored() -> None:
    assert orphan(chat(labels={})) is Action.IGNORE
    assert orphan(chat(labels=chat_labels("other", "wf-1"))) is Action.IGNORE
    assert orphan(chat(labels={"team": "x"}), grace=0) is Action.IGNORE


def test_stranded_chats_are_retired_without_grace_even_unlabelled() -> None:
    a = acct(stranded={"c1": ("wf-1", "CoderStreamError on its first turn")})
    d = plan_orphan(chat(age=1, labels={}), a, now=NOW, grace_s=600)
    assert d.action is Action.RETIRE and "stranded" in d.reason and d.workflow_id == "wf-1"
    archived = plan_orphan(chat(archived=True), a, now=NOW, grace_s=600)
    assert archived.action is Action.FORGET


def test_archived_unaccounted_chats_need_nothing() -> None:
    assert orphan(chat(archived=True)) is Action.KEEP


def test_stuck_running_or_interrupting_past_the_turn_budget_is_interrupted() -> None:
    for status in ("running", "interrupting"):
        d = plan_stuck(
            chat(status=status, idle=601), acct(), now=NOW, turn_budget_s=600, action_budget_s=60
        )
        assert d.action is Action.INTERRUPT and "turn budget" in d.reason
        ok = plan_stuck(
            chat(status=status, idle=599), acct(), now=NOW, turn_budget_s=600, action_budget_s=60
        )
        assert ok.action is Action.KEEP


def test_a_pause_nobody_answers_past_the_action_budget_is_interrupted() -> None:
    d = plan_stuck(
        chat(status="requires_action", idle=61),
        acct(),
        now=NOW,
        turn_budget_s=600,
        action_budget_s=60,
    )
    assert d.action is Action.INTERRUPT and "nobody answering" in d.reason
    ok = plan_stuck(
        chat(status="requires_action", idle=59),
        acct(),
        now=NOW,
        turn_budget_s=600,
        action_budget_s=60,
    )
    assert ok.action is Action.KEEP


def test_settled_and_foreign_chats_are_never_stuck() -> None:
    for status in ("waiting", "error", "completed"):
        d = plan_stuck(
            chat(status=status, idle=1e9), acct(), now=NOW, turn_budget_s=1, action_budget_s=1
        )
        assert d.action is Action.KEEP
    foreign = plan_stuck(
        chat(status="running", idle=1e9, labels={}),
        acct(),
        now=NOW,
        turn_budget_s=1,
        action_budget_s=1,
    )
    assert foreign.action is Action.IGNORE
    # a checkpointed chat is ours by record even without labels (created before them)
    mine = plan_stuck(
        chat(status="running", idle=1e9, labels={}),
        acct(checkpointed={"c1": "wf-9"}),
        now=NOW,
        turn_budget_s=1,
        action_budget_s=1,
    )
    assert mine.action is Action.INTERRUPT and mine.workflow_id == "wf-9"


def test_a_paused_chat_with_ledger_entries_is_reconciled_not_interrupted() -> None:
    d = plan_orphan(chat(status="requires_action"), acct(), now=NOW, grace_s=0)
    assert paused_refinement(d, status="requires_action", has_ledger_entries=True).action is (
        Action.RECONCILE
    )
    assert paused_refinement(d, status="requires_action", has_ledger_entries=False) == d
    assert paused_refinement(d, status="waiting", has_ledger_entries=True) == d
    keep = plan_orphan(
        chat(status="requires_action"), acct(checkpointed={"c1": "wf"}), now=NOW, grace_s=0
    )
    assert paused_refinement(keep, status="requires_action", has_ledger_entries=True) == keep


def test_a_live_lease_holder_defers_any_action() -> None:
    d = plan_orphan(chat(), acct(), now=NOW, grace_s=0)
    busy = busy_refinement(d, lease_holder="host:1:abc")
    assert busy.action is Action.BUSY and "holds its lease" in busy.reason
    assert busy_refinement(d, lease_holder=None) == d
    wait = plan_orphan(chat(age=1), acct(), now=NOW, grace_s=60)
    assert busy_refinement(wait, lease_holder="x") == wait


def test_parse_time_reads_go_timestamps() -> None:
    assert parse_time("2027-01-15T08:00:00.123456789Z") == parse_time("2027-01-15T08:00:00.123456Z")
    assert parse_time("2027-01-15T10:00:00+02:00") == parse_time("2027-01-15T08:00:00Z")
    assert parse_time(None) is None and parse_time("garbage") is None
    assert parse_time("2027-01-15T08:00:00") is None  # naive: not comparable

"""The stuck-turn sweep's defaults act on a stuck client-tool pause before chatd does.

chatd cancels an unanswered ``requires_action`` pause after 5 minutes with
synthetic "Tool execution timed out" results (chatd-wire spec, ``EnterRequiresAction``
deadline) — even over an effect the tool ledger recorded. The sweep must
reconcile the pause first: its action budget plus one schedule interval (the
worst case between two runs) must stay under that timeout, in the code default
and in ``prefect.yaml``.
"""

from __future__ import annotations

import inspect

import yaml
from flow_helpers import ROOT
from prefect.client.schemas.schedules import CronSchedule

from coder_chat.emulator.config import Config
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns
from prefect_coder.flows.sweeps.run import DEFAULT_ACTION_BUDGET_S

#: chatd's requires_action timeout (spec: ``requiresActionTimeout = 5*time.Minute``).
CHATD_PAUSE_TIMEOUT_S = 300.0


def _interval_s(cron: str) -> float:
    """The gap between two runs of an every-N-minutes cron (``*`` or ``*/N``)."""
    minute, *rest = cron.split()
    assert rest == ["*"] * 4, f"an every-N-minutes schedule, not {cron!r}"
    return 60.0 * (1 if minute == "*" else int(minute.removeprefix("*/")))


def test_stuck_sweep_defaults_reconcile_a_pause_before_chatd_times_it_out() -> None:
    assert Config().requires_action_timeout == CHATD_PAUSE_TIMEOUT_S  # the emulator plays it too
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    [dep] = [d for d in config["deployments"] if d["name"] == "sweep-stuck-turns"]
    [schedule] = dep["schedules"]
    CronSchedule(cron=schedule["cron"])  # a valid Prefect schedule
    interval = _interval_s(schedule["cron"])
    budget = dep["parameters"]["action_budget_s"]
    assert budget + interval < CHATD_PAUSE_TIMEOUT_S, (budget, interval)
    # Called without the parameter (a UI run, a test), the flow's default holds too.
    default = inspect.signature(sweep_stuck_turns.fn).parameters["action_budget_s"].default
    assert default == DEFAULT_ACTION_BUDGET_S
    assert DEFAULT_ACTION_BUDGET_S + interval < CHATD_PAUSE_TIMEOUT_S

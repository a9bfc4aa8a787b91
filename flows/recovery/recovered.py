"""An earlier attempt's result rebuilt from history, what recovery found on a step's
checkpointed chat (:data:`Found`: one of :class:`Unsent`, :class:`Finished`,
:class:`Running`, :class:`Archived`), recovery's bounds (:func:`recovery_timings`) and
its report (:func:`publish_recovery`): what every way of recovering a step hands back."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prefect.artifacts import acreate_table_artifact

from coder_chat.core.fields import field, plain
from coder_chat.core.usage import usage_of_messages
from coder_chat.errors import CoderError
from coder_chat.history import DynamicToolPart, fetch_until
from coder_chat.recovery import RecoveryOutcome, RecoveryTimings
from coder_chat.rest import ChatClient
from coder_chat.results import GenerateResult
from coder_chat.tools import ClientTool
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.common.results import ToolCallRecord, TurnResult
from prefect_coder.flows.observe.artifacts import artifact_key
from prefect_coder.flows.observe.run_log import run_logger

__all__ = [
    "Archived",
    "Finished",
    "Found",
    "Running",
    "Unsent",
    "publish_recovery",
    "recovered_result",
    "recovery_timings",
    "turn_fields",
    "turn_history",
]


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def recovery_timings(
    settings: WorkflowSettings, request_timeout: float | None, turn_timeout: float | None
) -> RecoveryTimings:
    """Recovery bounds of a workflow.

    * probe/interrupt bound: ``settings.settle_wait_s`` (15 s);
    * commit horizon: the per-segment ``request_timeout`` — the design's
      conservative horizon for a send still in flight (300 s) — or
      ``PREFECT_CODER_COMMIT_HORIZON_S``;
    * settle budget: the turn's total bound (600 s), turn-scale;
    * poll interval: 1 s, or ``PREFECT_CODER_SETTLE_POLL_S``.
    """
    d = RecoveryTimings()
    horizon = _env_float("PREFECT_CODER_COMMIT_HORIZON_S")
    poll = _env_float("PREFECT_CODER_SETTLE_POLL_S")
    return RecoveryTimings(
        probe_bound=settings.settle_wait_s,
        settle_budget=turn_timeout or d.settle_budget,
        poll_interval=d.poll_interval if poll is None else poll,
        commit_horizon=horizon if horizon is not None else (request_timeout or d.commit_horizon),
    )


# --- what recovery found: one finding per shape, each with only what it needs -----------
# (flows/turn/decide.py rules on them; no rule reads a combination of optional fields)


@dataclass(frozen=True, slots=True)
class Unsent:
    """No attempt of the step is left running or finished: send attempt ``attempt``
    (1: it never sent — its write-ahead is journaled; more: the earlier attempts were
    cut short and the resubmission is journaled)."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The earlier attempt ``attempt`` finished and its result was lost: ``result``,
    rebuilt from history. Return it, send nothing."""

    attempt: int
    result: TurnResult


@dataclass(frozen=True, slots=True)
class Running:
    """The earlier attempt ``attempt`` was still running and was followed to its
    settle: ``gen`` is what its ``generate()`` would have returned. Nothing sent."""

    attempt: int
    gen: GenerateResult


@dataclass(frozen=True, slots=True)
class Archived:
    """The checkpointed chat is archived and holds no finished attempt of the step: it
    continues in a fresh chat (which becomes the checkpoint). ``adopted``: an earlier
    fresh attempt's chat, created but never checkpointed, that holds only this step —
    adopted (the checkpoint now): the step is recovered there instead."""

    adopted: str | None = None


#: What recovering a step's checkpointed chat found before its send.
Found = Unsent | Finished | Running | Archived


def turn_fields(messages: Iterable[Any], user_message_id: int) -> tuple[list[int], dict[str, Any]]:
    """``message_ids`` and ``usage`` of the turn a user message started, from history.

    As ``generate()`` reports them: the ids of the turn's assistant and tool
    messages (those after the user message, up to the chat's next user message),
    and the wire ``usage`` of its assistant messages summed per message
    (:func:`coder_chat.core.usage.usage_of_messages`). History carries both
    (``ChatMessage.usage``); a message without usage adds nothing. Pure."""
    ordered = sorted(messages, key=lambda m: int(field(m, "id", 0)))
    ids: list[int] = []
    usage: dict[int, dict[str, Any]] = {}
    for m in ordered:
        mid = int(field(m, "id", 0))
        if mid <= user_message_id:
            continue
        role = field(m, "role")
        if role == "user":
            break  # the next turn starts here
        if role not in ("assistant", "tool"):
            continue
        ids.append(mid)
        raw = plain(field(m, "usage")) if role == "assistant" else None
        if isinstance(raw, dict):
            usage[mid] = raw
    total = usage_of_messages(usage)
    summary = {k: v for k, v in dataclasses.asdict(total).items() if k != "raw" and v is not None}
    return ids, summary


def recovered_result(
    workflow_id: str,
    step: Step,
    outcome: RecoveryOutcome,
    tools: Sequence[ClientTool[Any]],
    messages: Iterable[Any] | None = None,
) -> TurnResult:
    """The step's result rebuilt from history (what ``generate()`` would have returned).

    ``messages``: the chat's history from the turn's user message on (at least);
    with it ``message_ids`` and ``usage`` are filled as ``generate()`` fills them
    (:func:`turn_fields`), without it they stay empty."""
    rec = outcome.recovered
    assert rec is not None
    message_ids, usage = (
        turn_fields(messages, rec.user_message_id) if messages is not None else ([], {})
    )
    names = {t.name for t in tools}
    calls = [
        ToolCallRecord(
            id=p.tool_call_id,
            name=p.tool_name,
            kind="client" if p.tool_name in names else "server",
            args=p.input,
            output=p.output if p.state == "output-available" else p.error_text,
            is_error=p.state == "output-error",
        )
        for p in rec.parts
        if isinstance(p, DynamicToolPart)
    ]
    structured = rec.structured.model_dump(mode="json") if rec.structured is not None else None
    return TurnResult(
        workflow_id=workflow_id,
        step=step.name,
        marker=outcome.marker,
        chat_id=outcome.chat_id,
        text=rec.text,
        finish_reason="stop",
        usage=usage,
        user_message_id=rec.user_message_id,
        message_ids=message_ids,
        tool_calls=calls,
        structured=structured,
        attempt=max(1, outcome.attempts),
        generate_ms=0.0,
    )


async def turn_history(
    client: ChatClient, chat_id: str, user_message_id: int, *, bound_s: float
) -> list[Any] | None:
    """The chat's history from the user message ``user_message_id`` on, for
    :func:`recovered_result` (its ``message_ids`` and ``usage``) when the recovery
    that rebuilt the result did not hand its messages over. ``None`` when it cannot
    be read within ``bound_s`` per request: the result then carries both empty —
    its text, calls and answer are already recovered, and a field of record must
    not fail the step."""
    try:
        messages, _ = await fetch_until(
            client,
            chat_id,
            lambda ms: any(int(field(m, "id", 0)) <= user_message_id for m in ms),
            timeout=bound_s,
        )
    except CoderError:
        run_logger(__name__).warning(
            "could not read chat %s's history for the recovered result's message ids and "
            "usage; they stay empty",
            chat_id,
            exc_info=True,
        )
        return None
    return messages


async def publish_recovery(
    workflow_id: str, step_name: str, outcome: RecoveryOutcome, *, artifacts: bool = True
) -> None:
    """Log the verdict and publish the decisions as a table artifact."""
    log = run_logger(__name__)
    log.info(
        "recovery of %s/%s on chat %s: %s (%s); %d decision(s), horizon slept %.2fs",
        workflow_id,
        step_name,
        outcome.chat_id,
        outcome.classification,
        outcome.reason,
        len(outcome.decisions),
        outcome.horizon_slept_s,
    )
    if not artifacts:
        return
    try:
        await acreate_table_artifact(
            key=artifact_key(workflow_id, step_name, kind="recovery", slug_len=70),
            table=[d.row() for d in outcome.decisions],
            description=(
                f"Crash recovery of step `{step_name}` of `{workflow_id}` on chat "
                f"`{outcome.chat_id}`: **{outcome.classification}** — {outcome.reason}"
            ),
        )
    except Exception:
        log.warning("could not publish the recovery artifact", exc_info=True)

"""Transport events and turn outcomes as Prefect log lines and Prefect events.

The pure half, :func:`describe`, classifies one transport event; the thin shell,
:class:`TurnObserver`, writes the log line and emits the Prefect event.
Automations can trigger on the event names (``coder.stream.redial``,
``coder.segment.failed``, ``coder.turn.failed``, ``coder.chat.stranded`` …);
the resource is ``coder.chat.<chat_id>`` (labelled ``coder.workflow-id``) or
``coder.workflow.<id>`` before the chat exists, labelled ``coder.step``, and the
workflow is always a related resource.

Nothing here sees the token: transport events carry paths and stream URLs only,
and the error texts of ``coder_chat.errors`` are built without it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from prefect.events import emit_event

from coder_chat.events import (
    SegmentSettle,
    SegmentStart,
    ToolRun,
    TransportEvent,
    WsError,
    WsRedial,
)
from prefect_coder.flows.observe import background

if TYPE_CHECKING:
    from prefect_coder.flows.observe.live_progress import LiveProgress

__all__ = ["OperatorNote", "TransportRouter", "TurnObserver", "chat_resource", "describe"]


@dataclass(frozen=True, slots=True)
class OperatorNote:
    """What one transport event means for the operator."""

    level: int
    message: str
    event: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)


def describe(ev: TransportEvent) -> OperatorNote | None:
    """Classify a transport event; ``None`` for the per-frame noise we do not log."""
    if isinstance(ev, WsRedial):
        # Early warning: the server keeps generating and nothing is lost yet, but
        # the turn fails when consecutive failures reach the cap.
        return OperatorNote(
            logging.WARNING,
            f"stream redial {ev.consecutive_failures}/{ev.max_consecutive_failures} on chat "
            f"{ev.chat_id} (connection {ev.reader}.{ev.attempt} ended), next dial in "
            f"{ev.backoff_ms} ms",
            "coder.stream.redial",
            {
                "consecutive_failures": ev.consecutive_failures,
                "max_consecutive_failures": ev.max_consecutive_failures,
                "backoff_ms": ev.backoff_ms,
                "reader": ev.reader,
                "attempt": ev.attempt,
            },
        )
    if isinstance(ev, SegmentSettle):
        payload: dict[str, Any] = {
            "segment": ev.segment,
            "ending": ev.ending,
            "status": ev.status,
            "finish_reason": ev.finish_reason,
            "duration_ms": round(ev.duration_ms, 1),
        }
        if ev.ending == "clean":
            # A debug line only: clean settles are the bulk of all events, and the
            # turn's own coder.turn.settled event (and its "settled" log line)
            # already counts its segments; an INFO line per segment cost every turn
            # a record through Prefect's API log handler.
            return OperatorNote(
                logging.DEBUG,
                f"segment {ev.segment} settled: status={ev.status or '-'} "
                f"finish={ev.finish_reason} in {ev.duration_ms:.0f} ms",
                None,
                payload,
            )
        if ev.ending == "failure":
            err = ev.error or {}
            payload["error"] = {"name": err.get("name"), "message": err.get("message")}
            return OperatorNote(
                logging.WARNING,
                f"segment {ev.segment} failed after {ev.duration_ms:.0f} ms: "
                f"{err.get('name')}: {err.get('message')}"
                + (f" (server status {ev.status})" if ev.status else ""),
                "coder.segment.failed",
                payload,
            )
        return OperatorNote(
            logging.INFO,
            f"segment {ev.segment} torn down after {ev.duration_ms:.0f} ms",
            "coder.segment.teardown",
            payload,
        )
    if isinstance(ev, WsError):
        return OperatorNote(logging.DEBUG, f"stream error on chat {ev.chat_id}: {ev.message}")
    if isinstance(ev, SegmentStart):
        return OperatorNote(logging.DEBUG, f"segment {ev.segment} started")
    if isinstance(ev, ToolRun):
        # One line per client tool call, so the run's log tells what the turn did
        # while it ran (issue 31: the logs showed nothing during a 55 s turn). The
        # name, time and outcome only: arguments and output may hold secrets.
        said = {
            "ok": "answered",
            "error": f"failed: {ev.error or 'invalid input'} (the model was told)",
            "failed-turn": "could not be recorded: the turn fails and recovery finishes it",
        }[ev.outcome]
        return OperatorNote(
            logging.INFO if ev.outcome == "ok" else logging.WARNING,
            f"tool {ev.tool_name} (call {ev.tool_call_id}) {said} in {ev.duration_ms / 1000:.2f} s",
        )
    return None


def chat_resource(chat_id: str | None, workflow_id: str, step: str | None = None) -> dict[str, str]:
    """The Prefect event resource of a turn: its chat (labelled with the workflow id), or
    its workflow before one exists; labelled with the step when given.

    The step is a label of the resource, not a related resource of its own: every
    related resource is a stored row per event on the Prefect server (≈ 0.5 ms of its
    CPU each, docs/performance.md round 11a), and the step was already in the payload.
    Automations match it with ``match: {"coder.step": ...}``, event filters with
    ``resource.labels``."""
    resource = (
        {"prefect.resource.id": f"coder.chat.{chat_id}", "coder.workflow-id": workflow_id}
        if chat_id
        else {"prefect.resource.id": f"coder.workflow.{workflow_id}"}
    )
    if step is not None:
        resource["coder.step"] = step
    return resource


class TurnObserver:
    """``on_transport_event`` hook of one turn: logs + Prefect events, never raises."""

    def __init__(
        self,
        *,
        workflow_id: str,
        step: str,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        chat_id: str | None = None,
        progress: LiveProgress | None = None,
    ) -> None:
        self.workflow_id = workflow_id
        self.step = step
        self.logger = logger
        self.chat_id = chat_id
        # The turn's live artifact: fed every event, finished by the turn's
        # coder.turn.settled / coder.turn.failed event.
        self.progress = progress
        self.redials = 0
        self.segments = 0

    def __call__(self, ev: TransportEvent) -> None:
        chat_id = getattr(ev, "chat_id", None)
        if chat_id:
            self.chat_id = chat_id
        if self.progress is not None:
            try:
                self.progress(ev)
            except Exception:  # observability must never break a turn
                self.logger.debug("live progress failed on %s", ev.type, exc_info=True)
        obs = describe(ev)
        if obs is None:
            return
        if isinstance(ev, WsRedial):
            self.redials += 1
        elif isinstance(ev, SegmentSettle):
            self.segments += 1
        self.logger.log(obs.level, "[%s] %s", self.step, obs.message)
        if obs.event:
            self.emit(obs.event, obs.payload)

    def emit(self, event: str, payload: dict[str, Any], *, deferred: bool = False) -> None:
        """Emit a Prefect event about this turn (errors are logged, never raised).

        ``deferred``: build and queue it in the loop's next background batch
        (:func:`prefect_coder.flows.observe.background.defer`) instead of now, off the
        turn's path; it keeps the time it happened and the run context it happened
        in (its task run stays a related resource), and the flow's end flushes it.
        """
        if self.progress is not None and event in ("coder.turn.settled", "coder.turn.failed"):
            if event == "coder.turn.settled":
                outcome = f"settled, finish reason `{payload.get('finish_reason')}`"
            else:
                outcome = f"failed: {payload.get('error')}: {payload.get('message', '')}"
            try:
                self.progress.finish(outcome)
            except Exception:  # observability must never break a turn
                self.logger.debug("could not finish the live progress", exc_info=True)
        occurred = datetime.now(UTC)
        resource = chat_resource(self.chat_id, self.workflow_id, self.step)
        if deferred:
            background.defer(
                functools.partial(self._send, event, resource, payload, occurred),
                name=f"event {event}",
            )
        else:
            self._send(event, resource, payload, occurred)

    def _send(
        self, event: str, resource: dict[str, str], payload: dict[str, Any], occurred: datetime
    ) -> None:
        try:
            emit_event(
                event,
                resource=resource,
                occurred=occurred,
                # The workflow is the one related resource of our own (what "every
                # event of workflow X" filters on); Prefect adds the run context's
                # (flow run, task run, flow). The step is a resource label.
                related=[
                    {
                        "prefect.resource.id": f"coder.workflow.{self.workflow_id}",
                        "prefect.resource.role": "workflow",
                    },
                ],
                payload={"workflow_id": self.workflow_id, "step": self.step, **payload},
            )
        except Exception:  # observability must never break a turn
            self.logger.debug("could not emit %s", event, exc_info=True)


class TransportRouter:
    """The ``on_transport_event`` hook of a ``ChatClient`` shared by several turns.

    A client is expensive to build (its TLS context alone took ≈ 40 ms), so a
    workflow builds one and hands it to every turn's agent. A pre-built client
    reports HTTP/WS events through its own hook, fixed at construction; this
    router forwards them to whichever turn is running (turns are sequential).
    """

    def __init__(self) -> None:
        self.target: Callable[[TransportEvent], object] | None = None

    def __call__(self, ev: TransportEvent) -> object:
        target = self.target
        return None if target is None else target(ev)

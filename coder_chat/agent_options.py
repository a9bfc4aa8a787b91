"""What a :class:`~coder_chat.agent.CoderAgent` is built with, checked before any I/O.

* :class:`AgentTimings`: the agent's time constants (tests shorten them).
* :class:`AgentHooks`: what only a durable caller sets (``prefect_coder``'s
  durable turn): awaited hooks before a send and before an interrupt, and the
  leave-landed-runs policy. A plain SDK user passes none of it.
* :class:`ChatOptions` and :func:`check_session`: the chat-creation options and
  the session a constructor or ``resume()`` is given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coder_chat.errors import CoderAgentError
from coder_chat.models import ChatInputPart, CreateChatRequest, DynamicToolDefinition
from coder_chat.tools import ClientTool

__all__ = ["AgentHooks", "AgentTimings", "ChatOptions", "check_session"]

#: Largest timer value the TypeScript SDK accepts (ms); larger/invalid → default.
_MAX_DELAY_S = (2**31 - 1) / 1000.0


def _sane_delay(value: float | None, default: float) -> float:
    if value is None or not isinstance(value, int | float) or isinstance(value, bool):
        return default
    if value != value or value < 0 or value > _MAX_DELAY_S:  # NaN, negative, huge
        return default
    return float(value)


@dataclass(frozen=True, slots=True)
class AgentTimings:
    """Time constants of the agent (seconds). Tests shorten them; production keeps defaults.

    ``action_grace``: wait for a lost ``action_required`` before recovering it from
    history (2 s). ``settle_deadline``: archive window (15 s). ``settle_retry_delay``:
    archive's poll interval: status re-reads while a run winds down, retries on
    409 (1 s). ``wind_down``: bound of the
    max-steps wind-down submit/interrupt (8 s). ``interrupt``: bound of each
    best-effort interrupt / queue withdrawal (15 s).
    """

    action_grace: float = 2.0
    settle_deadline: float = 15.0
    settle_retry_delay: float = 1.0
    wind_down: float = 8.0
    interrupt: float = 15.0

    def sanitized(self) -> AgentTimings:
        d = AgentTimings()
        return AgentTimings(
            action_grace=_sane_delay(self.action_grace, d.action_grace),
            settle_deadline=_sane_delay(self.settle_deadline, d.settle_deadline),
            settle_retry_delay=_sane_delay(self.settle_retry_delay, d.settle_retry_delay),
            wind_down=_sane_delay(self.wind_down, d.wind_down),
            interrupt=_sane_delay(self.interrupt, d.interrupt),
        )


#: ``before_send(chat_id_or_None)``: ``None`` before the chat's creation.
BeforeSend = Callable[[str | None], Awaitable[None]]
#: ``before_interrupt(chat_id)``.
BeforeInterrupt = Callable[[str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class AgentHooks:
    """What a durable caller with its own crash recovery hands the agent
    (``CoderAgent(hooks=AgentHooks(...))``); the defaults are the plain SDK's.

    Each field closes one failure window of a caller that journals its turns
    and recovers them in another process:

    ``before_send``: awaited with the chat id (``None`` before a create) right
        before every prompt the agent sends — a chat's creation or a user
        message, never tool results (they continue a turn already running). If
        it raises, nothing is sent, no interrupt is fired (nothing was cut
        short) and the turn fails with that error. *Window:* a process that
        stalled (a starved loop, a paused VM) between claiming a capacity slot
        or a lease and sending may have lost it; proving it here shrinks the
        window between claiming and sending to the request itself, so a turn
        never runs over the fleet's cap or beside the run that took over.

    ``before_interrupt``: awaited with the chat id before every interrupt the
        agent sends of its own turn's chat (a failed segment's teardown, the
        step cap's wind-down). If it raises, that interrupt is not sent (the run
        is left for the caller's recovery, which must then find it live).
        *Window:* an interrupt truncates the attempt; a caller that journals
        "cut short" here first means a later recovery never mistakes the
        truncated attempt (or its own 409) for a finished one.

    ``leave_landed_runs``: a segment that fails *transiently* (a transport
        error — e.g. a POST that landed but whose response was lost — or a
        408/425/429/5xx answer) after its submission went out does NOT
        interrupt the chat; :attr:`CoderAgent.left_run_live` names the chat.
        *Window:* the run may be the turn's own live continuation; interrupting
        it throws the work away, and a resubmission lets the model repeat a
        committed tool call under a new call id — the caller's recovery follows
        it with ``follow()`` instead. Default off: the plain SDK stops what
        nobody reads (agent-semantics §5.3).
    """

    before_send: BeforeSend | None = None
    before_interrupt: BeforeInterrupt | None = None
    leave_landed_runs: bool = False


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How the agent's first turn creates its chat (ignored when resuming)."""

    organization_id: str | None = None
    system_prompt: str | None = None
    labels: Mapping[str, str] | None = None
    workspace_id: str | None = None
    mcp_server_ids: Sequence[str] | None = None
    model_config_id: str | None = None

    def create_request(
        self, content: list[ChatInputPart], tools: Sequence[ClientTool[Any]]
    ) -> CreateChatRequest:
        org = self.organization_id
        if not org:
            raise CoderAgentError(
                "organization_id is required to create a chat (pass it or set CODER_ORG_ID)"
            )
        definitions = [
            DynamicToolDefinition(
                name=t.name, description=t.description, input_schema=t.input_schema()
            )
            for t in tools
        ]
        return CreateChatRequest(
            organization_id=org,
            content=content,
            client_type="api",
            system_prompt=self.system_prompt,
            unsafe_dynamic_tools=definitions or None,
            model_config_id=self.model_config_id,
            workspace_id=self.workspace_id,
            mcp_server_ids=list(self.mcp_server_ids) if self.mcp_server_ids else None,
            labels=dict(self.labels) if self.labels else None,
        )


def check_session(chat_id: str | None, last_seen_message_id: int | None) -> None:
    """The session a constructor or :meth:`CoderAgent.resume` is given: a non-empty
    chat id, and a cursor only with it, a positive JSON-safe integer."""
    if last_seen_message_id is not None:
        if (
            isinstance(last_seen_message_id, bool)
            or not isinstance(last_seen_message_id, int)
            or last_seen_message_id <= 0
            or last_seen_message_id > 2**53 - 1
        ):
            raise CoderAgentError("last_seen_message_id must be a positive integer")
        if not chat_id:
            raise CoderAgentError("last_seen_message_id requires chat_id")
    if chat_id is not None and (not isinstance(chat_id, str) or not chat_id):
        raise CoderAgentError("chat_id must be a non-empty string")

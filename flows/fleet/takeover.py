"""May a gone holder's turn slot be taken — before its ttl, or after it?

A turn slot stands for a turn running *server-side*: chatd runs the agent loop,
so when the process that held a slot dies, its turn goes on (and recovery may
even follow it). Taking the slot as soon as Prefect shows the holder's run
Crashed let the fleet run cap + 1 turns; waiting out the ttl stalled the fleet
for the whole ttl after a worker died. The rule in between: a slot is taken
over at once when

1. its holder names a flow run Prefect shows in a final state (Crashed, Failed,
   Cancelled, Completed: ``holders.holder_over``), and
2. every chat of the holder's workflow is at rest on the server (status
   ``waiting``, ``error`` or ``completed``; not ``running``, ``pending``,
   ``requires_action``, ``interrupting`` or ``paused``). The chats are found by
   the workflow label every chat of this collection carries (so a first turn's
   chat counts even before its checkpoint was written) plus the workflow's
   checkpointed chat. A workflow with no chat at all (the holder died before
   creating it) passes: nothing of it can be running.

A slot whose lease **lapsed** (its holder stopped renewing without releasing it:
released rows are marked, ``blocks/state/leases.RELEASED``) is judged by rule 2
too, whatever Prefect says about the run: the holder is dead or stalled (a
starved event loop on a loaded machine, a store outage longer than the ttl),
and either way its turn may still run server-side. Taking a lapsed slot on the
ttl alone let the fleet run cap + 1 turns: for as long as a dead holder's turn
went on after the ttl (real turns run for minutes, the ttl is 60 s), and in CI,
where a 3 s test ttl lapsed under a stalled holder (3 turns at cap 2). A stalled
holder that wakes up renews its lapsed slot if nobody took it
(``Leases.renew``).

Either kind is taken at once, without asking the server, by a waiter of **the
same workflow**: it holds the workflow's lease (``durable_turn.execute_turn``
takes the lease before the slot), so the gone holder's turn is the very turn it
is about to follow or answer — one server-side turn, one slot. Without this a
recovery of a paused turn (``requires_action``: not at rest until someone
answers) waited for a slot that only its own answer could free.

Not known (a holder id without the workflow — an older worker —, no Coder
credentials to ask with, or an error while asking): a live lease of a run that
is over is not taken (the ttl decides, as before), a lapsed one once it has lapsed
a whole ttl (a slot its holder *abandoned* — a failed turn whose run may go on —
lapses at once, and a probe fails most likely for the reason the turn failed).
A chat that never comes to rest by itself still does in bounded time: chatd
ends a ``requires_action`` pause after 5 minutes and the stuck-turn sweep
interrupts a turn that runs too long.

Probes are bounded and cheap: only a slot whose holder's run is final is probed
(the Prefect answers are cached by ``holders``, and a waiter asks about all busy
slots' runs in one call, at most once a second), one ``GET /chats?label=…`` (and a
``GET /chats/{id}`` when the checkpointed chat was not listed), each bounded by
``PROBE_TIMEOUT_S`` (``PREFECT_CODER_SLOT_PROBE_TIMEOUT_S`` on the worker overrides
it); a "still busy" verdict is reused for ``BUSY_RECHECK_S``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable

from coder_chat.errors import CoderApiError
from coder_chat.models import AT_REST_STATUSES, Chat
from coder_chat.rest import ChatClient
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.common.holders import holder_over, holder_workflow_id
from prefect_coder.flows.common.labels import LABEL_WORKFLOW, label_value, owned_by, scope_labels

__all__ = [
    "BUSY_RECHECK_S",
    "PROBE_TIMEOUT_ENV",
    "PROBE_TIMEOUT_S",
    "Verdict",
    "judge_dead_slot",
    "probe_timeout_s",
]

#: Seconds a "its chat still runs" (or "could not tell") verdict is reused.
BUSY_RECHECK_S = 1.0
#: Bound of each Coder request of a probe (default).
PROBE_TIMEOUT_S = 5.0
#: Environment variable: the probe's bound in seconds, overriding ``PROBE_TIMEOUT_S``.
PROBE_TIMEOUT_ENV = "PREFECT_CODER_SLOT_PROBE_TIMEOUT_S"


def probe_timeout_s() -> float:
    """The bound of each Coder request of a probe: ``PREFECT_CODER_SLOT_PROBE_TIMEOUT_S``
    (seconds, > 0), else ``PROBE_TIMEOUT_S``. Read per probe: a probe is rare (only a
    slot whose holder is gone is probed), and tests set it for their process."""
    raw = os.environ.get(PROBE_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else PROBE_TIMEOUT_S
    except ValueError:
        return PROBE_TIMEOUT_S
    return value if value > 0 else PROBE_TIMEOUT_S


_logger = logging.getLogger(__name__)
_busy: dict[str, tuple[float, Verdict]] = {}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a waiter may do with a busy slot.

    ``take`` is True when the slot may be taken over now. Otherwise ``chat_id`` /
    ``status`` name a chat of the dead holder's workflow that is not at rest
    (``holder_over`` is True then), or both are None: the holder is live or unknown.
    """

    take: bool
    holder_over: bool = False
    chat_id: str | None = None
    status: str | None = None
    #: Taken because the holder ran the waiter's own workflow (the same turn).
    same_workflow: bool = False


_KEEP = Verdict(take=False)
_TAKE_UNKNOWN = Verdict(take=True)


async def judge_dead_slot(
    store: StateStore,
    holder: str,
    credentials: CoderCredentials | None,
    *,
    lapsed: bool = False,
    waiter_workflow: str | None = None,
    unknown_after: float = 0.0,
) -> Verdict:
    """Whether the slot ``holder`` holds may be taken now (see module doc).

    ``lapsed``: the slot's lease ran out unreleased (else it is live, and only a
    holder whose run Prefect shows over is considered). ``waiter_workflow``: the
    workflow of the waiter, which holds that workflow's lease.
    """
    # A lapsed slot nobody can judge passes on once it has lapsed a whole ttl more
    # (``unknown_after`` seconds from now): a slot its holder *abandoned* lapsed at once,
    # with its run possibly going on, and a probe fails most likely for the reason the
    # turn failed (the Coder server unreachable).
    take_unknown = lapsed and unknown_after <= 0
    workflow_id = holder_workflow_id(holder)
    if workflow_id is None or credentials is None:
        return _TAKE_UNKNOWN if take_unknown else _KEEP
    if not lapsed and not await holder_over(holder):
        return _KEEP
    if waiter_workflow is not None and workflow_id == waiter_workflow:
        return Verdict(take=True, holder_over=True, same_workflow=True)
    now = time.monotonic()
    cached = _busy.get(holder)
    if cached is not None and now - cached[0] < BUSY_RECHECK_S:
        return cached[1]
    if len(_busy) > 1_000:  # a long-lived worker: forget old answers
        _busy.clear()
    try:
        async with credentials.get_client() as client:
            found = await _chat_not_at_rest(client, store, workflow_id)
    except Exception as exc:  # don't know: the ttl decides (a lapsed slot's has)
        _logger.debug("could not probe the chats of workflow %s", workflow_id, exc_info=True)
        if take_unknown:
            return _TAKE_UNKNOWN
        verdict = Verdict(take=False, holder_over=True, status=f"unknown ({type(exc).__name__})")
    else:
        if found is None:
            _busy.pop(holder, None)
            return Verdict(take=True, holder_over=True)
        verdict = Verdict(take=False, holder_over=True, chat_id=found.id, status=found.status)
    _busy[holder] = (time.monotonic(), verdict)
    return verdict


def _tree(chats: Iterable[Chat]) -> Iterable[Chat]:
    for chat in chats:
        yield chat
        yield from _tree(chat.children)


async def _chat_not_at_rest(client: ChatClient, store: StateStore, workflow_id: str) -> Chat | None:
    """A chat of the workflow (or one of its sub-agent chats) not at rest, or None."""
    value = label_value(workflow_id)
    labels = {**scope_labels(store.tenant), LABEL_WORKFLOW: value}
    listed: set[str] = set()
    timeout = probe_timeout_s()
    async for root in client.iter_chats(labels=labels, timeout=timeout):
        # Re-checked: a server that ignored the filter must not make someone else's
        # chat hold our slot (nor free it).
        if not owned_by(root.labels, store.tenant) or root.labels.get(LABEL_WORKFLOW) != value:
            continue
        for chat in _tree([root]):
            listed.add(chat.id)
            if chat.status not in AT_REST_STATUSES:
                return chat
    # The checkpointed chat too, should the listing not show it (archived, or created
    # without labels by an older version). Archived chats are never running (chatd
    # refuses to archive a running chat), so this is nearly always skipped.
    checkpoint = await store.checkpoints.get(workflow_id)
    if checkpoint is None or checkpoint.chat_id in listed:
        return None
    try:
        chat = await client.get_chat(checkpoint.chat_id, timeout=timeout)
    except CoderApiError as exc:
        if exc.status == 404:  # gone: nothing of it can run
            return None
        raise
    for one in _tree([chat]):
        if one.status not in AT_REST_STATUSES:
            return one
    return None

"""A first turn's orphan check: strand every chat of the workflow no checkpoint names.

A crash after a first turn's chat was created but before its id was
checkpointed leaves an orphan that may still be generating. Every chat carries
the workflow's label, so this finds every orphan, interrupts it and records it
stranded (the workflow's archive retires it). The turn runs it on a workflow
without a checkpoint — unless :func:`may_have_orphans` proves there can be none;
``recover-turn`` runs it under the workflow's lease.
"""

from __future__ import annotations

import asyncio

from coder_chat.rest import ChatClient
from coder_chat.stop import stop_chat
from prefect_coder.blocks import HeldLease, StateStore
from prefect_coder.flows.parts.labels import LABEL_WORKFLOW, label_value, owned_by, scope_labels
from prefect_coder.flows.parts.retry import is_retryable_failure
from prefect_coder.flows.parts.run_log import RunLogger, run_logger

__all__ = ["may_have_orphans", "strand_workflow_orphans"]

#: Backoffs between attempts of the whole check on a transient failure (a 503 on the
#: chat listing failed a whole ``recover-turn`` run; the chaos test's seed 89).
RETRY_BACKOFF_S = (0.5, 1.0, 2.0)


def may_have_orphans(lease: HeldLease, *, retried: bool) -> bool:
    """Whether a first turn must list the workflow's chats for orphans.

    Not when this is the first hold ever of the workflow's lease (fence 1: the
    store keeps released lease rows, and every other acquisition — a new run, a
    retry of the flow run, a takeover — bumps the fence) and the turn is not a
    retry within it: every chat of a workflow is created by a turn under that
    lease, so no earlier turn can have left one. A fan-out of fresh workflows
    then makes no listing per workflow (it was ≈ 2 % of a shard's loop and one
    ``GET /chats`` per workflow on the Coder server).

    Window: a store whose lease rows were wiped while chats of its tenant live
    on — those are found by the ``sweep-orphans`` deployment, not here.
    """
    return retried or lease.fence != 1


async def strand_workflow_orphans(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    *,
    keep: str | None = None,
    bound_s: float = 15.0,
    logger: RunLogger | None = None,
) -> list[str]:
    """Interrupt every live chat of the workflow no checkpoint accounts for, and
    record it stranded so the archive retires it. Returns their ids.

    Widened as the design asks: regardless of status (an orphaned first turn may
    settle on its own and then sit live and unarchived forever), and every
    orphan, not just the first.

    A transient failure (5xx, 429, a reset connection) re-runs the whole check
    after a short backoff, a few times: every part of it is idempotent (listing,
    stopping a stopped chat, re-recording a stranded one).
    """
    log = logger or run_logger(__name__)
    for backoff in (*RETRY_BACKOFF_S, None):
        try:
            return await _strand(client, store, workflow_id, keep, bound_s, log)
        except Exception as exc:
            if backoff is None or not is_retryable_failure(exc):
                raise
            log.warning(
                "orphan check of %s failed (%s); retrying in %.1fs", workflow_id, exc, backoff
            )
            await asyncio.sleep(backoff)
    raise AssertionError("unreachable")


async def _strand(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    keep: str | None,
    bound_s: float,
    log: RunLogger,
) -> list[str]:
    found: list[str] = []
    labels = {**scope_labels(store.tenant), LABEL_WORKFLOW: label_value(workflow_id)}
    async for chat in client.iter_chats(labels=labels, timeout=bound_s):
        # Re-checked: a server that ignored the filter must never make us touch
        # someone else's chat.
        if chat.id == keep or not owned_by(chat.labels, store.tenant):
            continue
        found.append(chat.id)
        # Stopped, not interrupted once: an interrupt of a client-tool pause makes
        # the server resume the model, which a single interrupt leaves running.
        await stop_chat(client, chat.id, timeout=bound_s)
        await store.stranded.record(workflow_id, chat.id, "orphan: no checkpoint names it")
        log.warning(
            "orphan chat %s of workflow %s interrupted, recorded for the archive",
            chat.id,
            workflow_id,
        )
    return found

"""Resolve a workflow's credentials and state store from its settings.

Both are loaded once per flow run and handed to every turn. Every way this can
go wrong (missing block, bad URL, no credentials in the environment) becomes a
:class:`~prefect_coder.flows.common.errors.WorkflowParameterError` naming the settings field — before
any chat is created.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

from pydantic import ValidationError

from coder_chat.events import TransportEvent
from coder_chat.rest import ChatClient
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.blocks.state import HeldLease, LeaseUnavailableError, workflow_key
from prefect_coder.blocks.state.store import StateStore
from prefect_coder.flows.common.errors import WorkflowBusyError, WorkflowParameterError
from prefect_coder.flows.common.holders import holder_run_over, run_holder
from prefect_coder.flows.common.labels import of_another_store, scope_labels
from prefect_coder.flows.common.params import WorkflowSettings, validate_base_url
from prefect_coder.flows.liveness.track import (
    WORKFLOW_FLOWS,
    record_start,
    this_run,
    workflow_record_key,
)
from prefect_coder.flows.observe.finish_log import quiet_routine_turn_finish
from prefect_coder.flows.observe.observer import TransportRouter, TurnObserver
from prefect_coder.flows.observe.run_log import run_logger

__all__ = [
    "FREEZE_ENV",
    "ContextRouter",
    "TurnResources",
    "freeze_startup_heap",
    "hold_workflow_lease",
    "load_credentials",
    "load_resources",
    "load_store",
    "shared_client",
    "warn_if_another_store_in_use",
    "warn_if_local_store_is_shared",
]


@dataclass(frozen=True, slots=True)
class TurnResources:
    """What a turn needs besides its parameters. Never serialised.

    ``lease`` is set when the caller (a workflow flow run) already holds the
    workflow's lease for all of its turns; a turn then does not take it again.
    ``client``/``router`` let the turns of one flow run share one ``ChatClient``.
    """

    credentials: CoderCredentials
    store: StateStore
    lease: HeldLease | None = None
    #: A client shared by the turns of one flow run, and the router of its events.
    client: ChatClient | None = None
    router: TransportRouter | None = None
    #: Markers of the steps before the turn's in its workflow (``run_steps`` sets them
    #: per step): a journal naming one proves the step never sent, no history read.
    #: None: the order is unknown (``agent-turn``, ``recover-turn``).
    earlier_steps: frozenset[str] | None = None


def _fields(exc: ValidationError) -> str:
    # Only locations: a ValidationError's text repeats the input values, and one
    # of them may be the token.
    return ", ".join(".".join(str(p) for p in e["loc"]) or "<root>" for e in exc.errors())


async def load_credentials(settings: WorkflowSettings) -> CoderCredentials:
    """The ``CoderCredentials`` named by ``settings.credentials_block`` (or from env)."""
    field = "settings.credentials_block"
    name = settings.credentials_block
    if name:
        try:
            creds = cast(CoderCredentials, await CoderCredentials.aload(name))
        except ValidationError as exc:
            raise WorkflowParameterError(
                field,
                f"the CoderCredentials block {name!r} has invalid fields ({_fields(exc)})",
                "edit the block in the Prefect UI (Blocks) or save it again",
            ) from None
        except ValueError:
            raise WorkflowParameterError(
                field,
                f"no CoderCredentials block named {name!r} exists on this Prefect server",
                "create it (UI: Blocks → Coder Credentials, or "
                f"CoderCredentials(...).save({name!r})) or fix the name",
            ) from None
    else:
        try:
            creds = CoderCredentials.from_env()
        except ValidationError as exc:
            raise WorkflowParameterError(
                field,
                f"empty, and the worker environment has no valid Coder credentials "
                f"({_fields(exc)})",
                "name a saved CoderCredentials block, or set CODER_URL, "
                "CODER_SESSION_TOKEN and CODER_ORG_ID on the worker",
            ) from None
        except (ValueError, KeyError) as exc:
            raise WorkflowParameterError(
                field,
                f"empty, and the worker environment has no Coder credentials ({exc})",
                "name a saved CoderCredentials block, or set CODER_URL, "
                "CODER_SESSION_TOKEN and CODER_ORG_ID on the worker",
            ) from None
    source = f"{field} ({name!r}).base_url" if name else "CODER_URL"
    validate_base_url(str(creds.base_url), source)
    return creds


_log = logging.getLogger(__name__)

#: Work pools whose workers this process has already counted (once per process).
_POOLS_CHECKED: set[str] = set()


async def warn_if_local_store_is_shared(store: StateStore, pool: str | None = None) -> int | None:
    """Say loudly when a run on a pool of several workers keeps its state in this
    machine's SQLite file: the other workers' runs use *their* files, so a workflow
    crashed here is invisible to a recovery there, and a sweep there would see this
    machine's chats as orphans. Once per process and pool; never fails a run.
    Returns the number of online workers counted (None: not checked)."""
    if store.backend != "sqlite":
        return None
    from prefect import get_client
    from prefect.context import FlowRunContext

    if pool is None:  # the pool of the flow run this code runs in, if any
        ctx = FlowRunContext.get()
        flow_run = ctx.flow_run if ctx is not None else None
        pool = flow_run.work_pool_name if flow_run is not None else None
    if not pool or pool in _POOLS_CHECKED:
        return None
    _POOLS_CHECKED.add(pool)
    try:
        async with get_client() as client:
            workers = await client.read_workers_for_work_pool(pool)
    except Exception:  # a check for the operator must never break a run
        _log.debug("could not count the workers of pool %r", pool, exc_info=True)
        return None
    online = sum(1 for w in workers if str(w.status).upper().endswith("ONLINE"))
    if online > 1:
        run_logger(__name__).warning(
            "LOCAL STATE STORE ON A SHARED POOL: this run keeps its checkpoints, journal, "
            "tool ledger and leases in this machine's SQLite file (%s), while work pool %r "
            "has %d workers online. Runs on the other workers use their own files: "
            "recovery there cannot see this workflow, and their sweeps see its chats as "
            "orphans. Save a PostgreSQL ChatStateStore and name it in "
            "CoderCredentials.store_block (docs/deploy.md, 'Several worker machines').",
            store.url,
            pool,
            online,
        )
    return online


#: (Coder URL, tenant, store identity) combinations this process has compared with
#: the chats on the server (once per process each).
_STORE_FENCES_CHECKED: set[tuple[str, str, str]] = set()
#: Live chats one start-up check reads: one page, not a sweep.
OTHER_STORE_PAGE = 100


async def warn_if_another_store_in_use(
    credentials: CoderCredentials, store: StateStore, *, timeout_s: float = 10.0
) -> list[str] | None:
    """Say loudly when the Coder server holds live chats of this run's tenant that
    another state store checkpoints (their ``prefect-coder/store`` label names another
    identity than :meth:`StateStore.identity`): two stores serve one tenant, e.g. one
    worker on its local SQLite default while the others share PostgreSQL. Each store
    sees only its own workflows — a workflow crashed under one is invisible to the
    other's recovery and reconciler, and the lease of one workflow id is not shared —
    and the sweeps of each can only leave the other's chats alone.

    One listing call (``OTHER_STORE_PAGE`` live chats), once per process for each
    (server, tenant, store); never fails a run. Returns the other stores' identities
    (empty: none seen; None: not checked)."""
    try:
        identity = await store.identity()
        key = (str(credentials.base_url), store.tenant, identity)
        if key in _STORE_FENCES_CHECKED:
            return None
        _STORE_FENCES_CHECKED.add(key)
        async with credentials.get_client() as client:
            chats = await client.list_chats(
                q="archived:false",
                labels=scope_labels(store.tenant),
                limit=OTHER_STORE_PAGE,
                timeout=timeout_s,
            )
    except Exception:  # a check for the operator must never break a run
        _log.debug("could not compare the store with the server's chats", exc_info=True)
        return None
    others = sorted({o for c in chats if (o := of_another_store(c.labels, identity))})
    if others:
        run_logger(__name__).warning(
            "ANOTHER STATE STORE SERVES THIS TENANT: the Coder server lists live chats of "
            "tenant %r checkpointed by the store %s, but this run's store (%s, %s) is "
            "store %s. Each store sees only its own workflows: a workflow crashed under "
            "one is invisible to the other's recovery and reconciler, and runs of one "
            "workflow id in both are not kept apart. Choose the store once, on the "
            "credentials block: save a shared (PostgreSQL) ChatStateStore and name it in "
            "CoderCredentials.store_block, for every deployment and worker "
            "(docs/deploy.md, 'Several worker machines').",
            store.tenant,
            ", ".join(others),
            store.backend,
            store.url,
            identity,
        )
    return others


async def load_store(
    settings: WorkflowSettings, credentials: CoderCredentials | None = None
) -> StateStore:
    """The state store of a run: the ``ChatStateStore`` its credentials block names
    (``CoderCredentials.store_block``: chosen once for every deployment), else the one
    ``settings.store_block`` names, else the local SQLite default.

    A run whose settings name a different store than its credentials fails here, at
    the edge: a sweep or a recovery reading another store than the workflows would
    see their chats as orphans (issue 31: a sweep on its worker's local SQLite file
    answered "would retire" for a chat checkpointed in the shared PostgreSQL store).
    ``credentials`` saves a block load when the caller has them already.
    """
    if credentials is None and settings.credentials_block:
        credentials = await load_credentials(settings)
    chosen = credentials.store_block if credentials is not None else None
    name = settings.store_block
    if chosen and name and name != chosen:
        raise WorkflowParameterError(
            "settings.store_block",
            f"names the store {name!r}, but the credentials block "
            f"{settings.credentials_block!r} keeps every deployment's state in {chosen!r}",
            "leave settings.store_block empty (the credentials' store is used), or change "
            "CoderCredentials.store_block for every deployment at once",
        )
    name = name or chosen
    if not name:
        store = ChatStateStore().get_store()
        await warn_if_local_store_is_shared(store)
        return store
    try:
        block = cast(ChatStateStore, await ChatStateStore.aload(name))
    except ValidationError as exc:
        raise WorkflowParameterError(
            "settings.store_block",
            f"the ChatStateStore block {name!r} has invalid fields ({_fields(exc)})",
            "edit the block in the Prefect UI (Blocks) or save it again",
        ) from None
    except ValueError:
        raise WorkflowParameterError(
            "settings.store_block",
            f"no ChatStateStore block named {name!r} exists on this Prefect server",
            f"create it (ChatStateStore(url=...).save({name!r})), leave the field empty "
            "for the local SQLite default, or fix the name",
        ) from None
    store = block.get_store()
    await warn_if_local_store_is_shared(store)
    return store


#: Environment variable: ``0`` leaves the garbage collector's generations alone.
FREEZE_ENV = "PREFECT_CODER_GC_FREEZE"
_frozen_in: int | None = None


def freeze_startup_heap() -> bool:
    """Once per process: move every object the garbage collector tracks now into its
    permanent generation (``gc.freeze()``); True if this call did it.

    By a workflow's first load the process holds Prefect, SQLAlchemy, pydantic and
    their caches — millions of objects that live as long as the process. Every full
    collection walked all of them: ONE took ≈ 1 s of a fan-out worker's loop (≈ 11 ms
    per turn over 100 one-turn workflows; docs/performance.md, round 8), the loop
    stopped meanwhile, and turns' garbage reaches the oldest generation (a turn
    outlives two young collections), so full collections keep coming. Frozen objects
    are never collected: only what is garbage at this moment, once, stays — the
    price of skipping them from then on. Per process id, so a forked child freezes
    its own heap. ``PREFECT_CODER_GC_FREEZE=0`` turns it off."""
    global _frozen_in
    pid = os.getpid()
    if _frozen_in == pid or os.environ.get(FREEZE_ENV, "1").strip() == "0":
        return False
    _frozen_in = pid
    gc.freeze()
    return True


async def load_resources(
    settings: WorkflowSettings, *, warn_other_stores: bool = False
) -> TurnResources:
    """Credentials and store for a workflow run (the first load of a process freezes
    its start-up heap: :func:`freeze_startup_heap`, and drops Prefect's routine
    "Finished in state Completed()" line of its turns:
    :func:`~prefect_coder.flows.observe.finish_log.quiet_routine_turn_finish`).

    ``warn_other_stores``: a workflow run's start (not a sweep's, which reports such
    chats itself, nor a failure handler's) says once per process when another store
    serves the tenant (:func:`warn_if_another_store_in_use`)."""
    freeze_startup_heap()
    quiet_routine_turn_finish()
    credentials = await load_credentials(settings)
    store = await load_store(settings, credentials)
    if warn_other_stores:
        await warn_if_another_store_in_use(credentials, store)
    return TurnResources(credentials, store)


@contextlib.asynccontextmanager
async def hold_workflow_lease(
    workflow_id: str, store: StateStore, settings: WorkflowSettings, *, step: str = "-"
) -> AsyncIterator[HeldLease]:
    """Hold the workflow's single-flight lease (waiting up to ``settings.lease_wait_s``).

    Two runs of one workflow never drive its chat at the same time: a chat is
    single-flight server-side, and a second prompt would queue behind the live
    run and burn its own timeout. The lease lives in the shared store, so this
    holds across worker processes and machines; it is renewed in the
    background and lapses ``settings.lease_ttl_s`` after a holder crashed —
    or at once when the holder's flow run (named in the holder id) is already
    in a final state in Prefect (Crashed, Failed, Cancelled, Completed).

    Taking it is where a deployment run of ``agent-workflow``, ``agent-turn`` or
    ``recover-turn`` for this workflow records itself for ``reconcile-workflows``
    (its deployment and all its parameters, ``flows/liveness/track.py``): the one
    place every run that drives a workflow passes, once it really drives it.
    """
    async with contextlib.AsyncExitStack() as stack:
        try:
            held = await stack.enter_async_context(
                store.lease(
                    workflow_key(workflow_id),
                    holder=run_holder(),
                    ttl=settings.lease_ttl_s,
                    wait=settings.lease_wait_s,
                    holder_gone=holder_run_over,
                )
            )
        except LeaseUnavailableError as exc:
            logger = logging.getLogger("prefect_coder.flows.lease")
            TurnObserver(workflow_id=workflow_id, step=step, logger=logger).emit(
                "coder.workflow.busy", {"waited_s": exc.waited}
            )
            raise WorkflowBusyError(workflow_id, exc.waited) from None
        run = this_run()
        if (
            run is not None
            and run.flow_name in WORKFLOW_FLOWS
            and run.parameters.get("workflow_id") == workflow_id
        ):
            await record_start(
                store,
                workflow_record_key(workflow_id),
                run,
                workflow_id=workflow_id,
                lease_keys=[workflow_key(workflow_id)],
            )
        yield held


class ContextRouter(TransportRouter):
    """A :class:`TransportRouter` whose target is per asyncio context.

    One client can then serve the turns of many workflows running at once in one
    process (a fan-out shard): a turn sets ``target`` in its own task's context,
    and the client's events — raised synchronously in the coroutine that made the
    request, or in a stream task the turn created after setting it — reach that
    turn's hook and no other. Sequential turns of one workflow work as before.
    """

    def __init__(self) -> None:
        self._var: contextvars.ContextVar[Callable[[TransportEvent], object] | None] = (
            contextvars.ContextVar(f"transport-router-{id(self)}", default=None)
        )
        super().__init__()

    @property
    def target(self) -> Callable[[TransportEvent], object] | None:
        return self._var.get()

    @target.setter
    def target(self, value: Callable[[TransportEvent], object] | None) -> None:
        self._var.set(value)


@contextlib.asynccontextmanager
async def shared_client(resources: TurnResources) -> AsyncIterator[TurnResources]:
    """``resources`` with one ``ChatClient`` for all the turns it is handed to (closed
    on exit). Already carrying one (a fan-out shard opened it for all its
    workflows): unchanged, and the opener closes it.

    Built once per shard rather than once per workflow: a client is an httpx pool
    whose connections are dialled anew for every workflow otherwise (measured: the
    client and its TCP connects ≈ 4 % of a shard's event loop)."""
    if resources.client is not None and resources.router is not None:
        yield resources
        return
    router = ContextRouter()
    async with resources.credentials.get_client(on_transport_event=router) as client:
        yield dataclasses.replace(resources, client=client, router=router)

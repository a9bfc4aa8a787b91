"""Thin I/O against the Coder deployment: the read-only probes, the client's own path
through the chat routes (create → list → stream dial → archive), and the smoke turn.

The chat routes and the smoke turn go through the product's client
(``coder_chat.rest.ChatClient``, ``ChatStreamReader``, ``stop_chat``, ``CoderAgent``), so
they exercise exactly what a workflow does. Every chat the doctor creates carries the
label ``prefect-coder/doctor`` (never the product's ``prefect-coder/collection``, so no
sweep ever counts it) and is archived before the doctor ends, run or not.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

from coder_chat.agent import CoderAgent
from coder_chat.errors import (
    CoderApiError,
    CoderChatError,
    CoderError,
    CoderStreamError,
    CoderTransportError,
)
from coder_chat.models import ChatInputPart, CreateChatRequest
from coder_chat.rest import EXPERIMENTAL_PREFIX, V2_PREFIX, ChatClient
from coder_chat.stop import stop_chat
from coder_chat.stream import ChatStreamReader, StreamOptions

from .build import BuildGuess
from .observed import Answer, CoderObserved, Failure, RoutesObserved, SmokeObserved
from .probe import Prober, classify_text
from .target import Target

__all__ = [
    "DOCTOR_LABEL",
    "SMOKE_PROMPT",
    "observe_coder",
    "observe_routes",
    "observe_smoke",
]

#: The label of every chat the doctor creates (value: the doctor run's id).
DOCTOR_LABEL = "prefect-coder/doctor"
ROUTE_PROMPT = "prefect-coder doctor: route check (no reply needed)"
SMOKE_PROMPT = "prefect-coder doctor smoke test: reply with the single word pong."
#: Bound of every single doctor request to Coder (the block's http_timeout if lower).
PROBE_TIMEOUT = 15.0
#: Bound of bringing a doctor chat to rest and archiving it: an interrupted run keeps
#: committing for a few seconds on a real server before the archive is accepted.
ARCHIVE_TIMEOUT = 30.0


def client_for(target: Target) -> ChatClient:
    """A ``ChatClient`` built exactly as ``CoderCredentials.get_client`` builds one."""
    return ChatClient(
        target.base_url,
        target.token,
        organization_id=target.organization_id,
        timeout=min(target.http_timeout, PROBE_TIMEOUT),
        verify=target.verify_tls,
    )


async def observe_coder(target: Target) -> CoderObserved:
    """The read-only probes, stopping where a failure makes the rest pointless."""
    base = CoderObserved(
        base_url=target.base_url,
        verify_tls=target.verify_tls,
        server=Answer("GET", "/api/v2/buildinfo"),
        organization_id=target.organization_id,
        organization_invalid=target.organization_raw is not None,
    )
    timeout = min(target.http_timeout, PROBE_TIMEOUT)
    async with Prober(
        target.base_url, target.token, verify=target.verify_tls, timeout=timeout
    ) as p:
        server = await p.get("/api/v2/buildinfo", auth=False)
        obs = replace(base, server=server)
        if server.status is None or server.server_error:
            return obs
        me = await p.get("/api/v2/users/me")
        obs = replace(obs, me=me)
        if me.status is None or me.server_error or me.status in (401, 403):
            return obs
        if target.organization_id is not None:
            models = await p.get(f"/api/v2/organizations/{target.organization_id}/chats/models")
            obs = replace(obs, models=models)
        one = [("limit", "1")]
        return replace(
            obs,
            v2_list=await p.get(V2_PREFIX, params=one),
            experimental_list=await p.get(EXPERIMENTAL_PREFIX, params=one),
            status_query=await p.get(V2_PREFIX, params=[*one, ("q", "status:waiting")]),
        )


def _answer_from(method: str, path: str, exc: BaseException, started: float) -> Answer:
    """The Answer a client error stands for (the client's errors carry no token)."""
    elapsed = (time.perf_counter() - started) * 1000.0
    if isinstance(exc, CoderApiError):
        return Answer(
            method, path, status=exc.status, message=exc.message, detail=exc.detail or "",
            elapsed_ms=elapsed,
        )  # fmt: skip
    if isinstance(exc, TimeoutError):
        return Answer(method, path, failure=Failure.TIMEOUT, detail=str(exc), elapsed_ms=elapsed)
    if isinstance(exc, CoderTransportError):
        text = f"{exc.reason}: {exc.detail or ''}".strip(": ")
        return Answer(
            method, path, failure=classify_text(text, timeout=isinstance(exc, TimeoutError)),
            detail=text, elapsed_ms=elapsed,
        )  # fmt: skip
    if isinstance(exc, CoderStreamError) and isinstance(exc.cause, CoderApiError):
        # The dial's own refusal (e.g. a 502 from a proxy), after the retry budget.
        return _answer_from(method, path, exc.cause, started)
    if isinstance(exc, CoderStreamError):
        text = str(exc.cause) if exc.cause is not None else exc.message
        return Answer(method, path, failure=classify_text(text), detail=text, elapsed_ms=elapsed)
    return Answer(
        method, path, failure=Failure.NETWORK, detail=f"{type(exc).__name__}: {exc}",
        elapsed_ms=elapsed,
    )  # fmt: skip


async def observe_routes(target: Target, build: BuildGuess | None, run_id: str) -> RoutesObserved:
    """Create a labelled doctor chat, find it in the listing, dial its stream, archive it.

    On B3 the chat is created empty (``waiting``, no model call); older builds need a
    first message, whose run is interrupted by the archive at once.
    """
    assert target.organization_id is not None
    labels = {DOCTOR_LABEL: run_id}
    empty = build is not None and build.build == "B3"
    request = CreateChatRequest(
        organization_id=target.organization_id,
        content=[] if empty else [ChatInputPart.text_part(ROUTE_PROMPT)],
        labels=labels,
        title="prefect-coder doctor" if empty else None,
    )
    async with client_for(target) as client:
        started = time.perf_counter()
        try:
            chat = await client.create_chat(request, timeout=PROBE_TIMEOUT)
        except (CoderError, TimeoutError) as exc:
            return RoutesObserved(create=_answer_from("POST", client.prefix, exc, started))
        create = Answer(
            "POST", client.prefix, status=201, message="Created",
            elapsed_ms=(time.perf_counter() - started) * 1000.0,
        )  # fmt: skip
        obs = RoutesObserved(create=create, chat_id=chat.id, created_empty=empty)
        try:
            obs = await _list_and_dial(client, obs, labels)
        finally:
            obs = await _archive(client, obs)
        return obs


async def _list_and_dial(
    client: ChatClient, obs: RoutesObserved, labels: dict[str, str]
) -> RoutesObserved:
    chat_id = obs.chat_id
    assert chat_id is not None
    list_path = f"{client.prefix}?label={DOCTOR_LABEL}:…"
    started = time.perf_counter()
    try:
        chats = await client.list_chats(labels=labels, limit=5, timeout=PROBE_TIMEOUT)
    except (CoderError, TimeoutError) as exc:
        obs = replace(obs, listing=_answer_from("GET", list_path, exc, started))
    else:
        obs = replace(
            obs,
            listing=Answer("GET", list_path, status=200),
            listed=any(c.id == chat_id for c in chats),
        )
    path = client.stream_path(chat_id)
    options = StreamOptions(
        backoff_initial_ms=50, backoff_cap_ms=100, max_consecutive_failures=1,
        open_timeout=PROBE_TIMEOUT,
    )  # fmt: skip
    reader = ChatStreamReader(client, chat_id, options=options)
    started = time.perf_counter()
    try:
        event = await reader.next_event(timeout=PROBE_TIMEOUT)
    except (CoderError, TimeoutError) as exc:
        return replace(obs, stream=_answer_from("GET", path, exc, started))
    finally:
        await reader.aclose()
    elapsed = (time.perf_counter() - started) * 1000.0
    first = None
    if event is not None:
        first = event.type + (f" {event.status.status}" if event.status is not None else "")
    return replace(
        obs, stream=Answer("GET", path, status=101, elapsed_ms=elapsed), first_event=first
    )


async def _archive(client: ChatClient, obs: RoutesObserved) -> RoutesObserved:
    assert obs.chat_id is not None
    try:
        result = await stop_chat(
            client, obs.chat_id, timeout=ARCHIVE_TIMEOUT, archive=True, poll_interval=0.2
        )
    except (CoderError, TimeoutError) as exc:
        return replace(obs, cleanup_error=f"{type(exc).__name__}: {exc}")
    if result.archived:
        return replace(obs, archived=True)
    return replace(obs, cleanup_error=f"still {result.status} after {ARCHIVE_TIMEOUT:.0f} s")


async def observe_smoke(target: Target, run_id: str, within: float) -> SmokeObserved:
    """One tiny turn with ``CoderAgent.generate`` in a doctor chat, then its archive."""
    client = client_for(target)
    agent = CoderAgent(
        client=client,
        organization_id=target.organization_id,
        labels={DOCTOR_LABEL: run_id},
        request_timeout=min(target.request_timeout, within),
    )
    reply: str | None = None
    latency: float | None = None
    error: str | None = None
    kind: str | None = None
    started = time.perf_counter()
    try:
        result = await agent.generate(SMOKE_PROMPT, timeout=within)
        latency = time.perf_counter() - started
        reply = result.text
    except CoderChatError as exc:
        error, kind = f"{exc.kind}: {exc.message}", exc.kind
    except TimeoutError:
        error, kind = f"no reply within {within:.0f} s", "timeout"
    except CoderApiError as exc:
        error = _answer_from("POST", client.prefix, exc, started).describe()
    except CoderError as exc:
        error = f"{type(exc).__name__}: {exc}"
    chat_id = agent.chat_id or agent.last_known_chat_id
    archived, cleanup_error = chat_id is None, None
    try:
        if chat_id is not None:
            done = await agent.archive(timeout=ARCHIVE_TIMEOUT)
            archived = done.archived or chat_id in done.archived_chat_ids
    except (CoderError, TimeoutError) as exc:
        cleanup_error = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(CoderError):
            await agent.aclose()
        await client.aclose()
    return SmokeObserved(
        chat_id=chat_id,
        reply=reply,
        latency_s=latency,
        error=error,
        error_kind=kind,
        archived=archived,
        cleanup_error=cleanup_error,
    )

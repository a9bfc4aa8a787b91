"""The labels every chat this collection creates carries, and who owns a chat.

chatd stores labels with the chat and filters ``GET /chats`` by them (``label=
key:value``, ANDed), so the sweeps list *only* chats this collection created
and never touch anyone else's. Four labels (chatd-wire §6.2: ≤ 50 labels; key
≤ 64 bytes matching ``^[a-zA-Z0-9][a-zA-Z0-9._/-]*$``; value non-empty,
≤ 256 bytes):

===============================  ==============================================
``prefect-coder/collection``      always ``prefect-coder``
``prefect-coder/tenant``          the state store's tenant: two stores sharing a
                                  Coder identity must use different tenants, or
                                  each would see the other's chats as orphans
``prefect-coder/workflow``        the workflow that created the chat
``prefect-coder/flow-run-id``     the Prefect flow run whose turn created it
``prefect-coder/store``           the identity of the state store that checkpoints
                                  it (``StateStore.identity``): a sweep acts only
                                  on chats of its own store
===============================  ==============================================

Values are sanitised (control characters → ``_``) and cut to 256 bytes with a
digest suffix, deterministically, so the value a sweep filters by is the value
the turn wrote. No I/O; Prefect is imported only by :func:`current_flow_run_id`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

__all__ = [
    "COLLECTION",
    "LABEL_COLLECTION",
    "LABEL_FLOW_RUN",
    "LABEL_STORE",
    "LABEL_TENANT",
    "LABEL_WORKFLOW",
    "MAX_KEY_BYTES",
    "MAX_LABELS",
    "MAX_VALUE_BYTES",
    "chat_labels",
    "current_flow_run_id",
    "label_problems",
    "label_value",
    "of_another_store",
    "owned_by",
    "scope_labels",
    "workflow_of",
]

COLLECTION = "prefect-coder"
LABEL_COLLECTION = "prefect-coder/collection"
LABEL_TENANT = "prefect-coder/tenant"
#: The turn's own first-turn orphan check (``parts.orphan_check``) filters by it too.
LABEL_WORKFLOW = "prefect-coder/workflow"
LABEL_FLOW_RUN = "prefect-coder/flow-run-id"
LABEL_STORE = "prefect-coder/store"

MAX_LABELS = 50
MAX_KEY_BYTES = 64
MAX_VALUE_BYTES = 256
_KEY_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._/-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DIGEST_CHARS = 16


def label_value(raw: object) -> str:
    """``raw`` as a valid label value: control characters replaced, surrounding
    whitespace stripped, at most 256 UTF-8 bytes.

    A value that had to be cut keeps its prefix and gains ``~<16 hex digits>`` of
    its SHA-256, so two long values that share a prefix stay distinct.
    """
    text = _CONTROL.sub("_", str(raw)).strip() or "_"
    data = text.encode()
    if len(data) <= MAX_VALUE_BYTES:
        return text
    digest = hashlib.sha256(data).hexdigest()[:_DIGEST_CHARS]
    room = MAX_VALUE_BYTES - len(digest) - 1
    head = data[:room].decode(errors="ignore")  # never split a multi-byte character
    return f"{head}~{digest}"


def scope_labels(tenant: str) -> dict[str, str]:
    """The label filter of everything this collection created for ``tenant``."""
    return {LABEL_COLLECTION: COLLECTION, LABEL_TENANT: label_value(tenant)}


def chat_labels(
    tenant: str,
    workflow_id: str,
    flow_run_id: object | None = None,
    store_id: str | None = None,
) -> dict[str, str]:
    """The labels a turn puts on the chat it creates."""
    labels = scope_labels(tenant)
    labels[LABEL_WORKFLOW] = label_value(workflow_id)
    if flow_run_id is not None and str(flow_run_id):
        labels[LABEL_FLOW_RUN] = label_value(flow_run_id)
    if store_id:
        labels[LABEL_STORE] = label_value(store_id)
    return labels


def of_another_store(labels: Mapping[str, str] | None, store_id: str | None) -> str | None:
    """The store a chat's labels name when it is NOT ``store_id`` (else None).

    A sweep must never act on such a chat: its own store has no checkpoint for it by
    construction, so every one would look like an orphan (issue 31: a sweep on its
    worker's local SQLite file answered "would retire" for a chat checkpointed in the
    shared PostgreSQL store). A chat without the label (made before it existed) or a
    sweep that does not know its store's identity: None (the older rules apply)."""
    named = (labels or {}).get(LABEL_STORE)
    if not named or not store_id or named == label_value(store_id):
        return None
    return named


def current_flow_run_id() -> str | None:
    """The id of the Prefect flow run this code runs in, if any (lazy Prefect import,
    so the rest of this module stays usable without Prefect's engine)."""
    from prefect.context import FlowRunContext, TaskRunContext

    task_ctx = TaskRunContext.get()
    if task_ctx is not None and task_ctx.task_run.flow_run_id is not None:
        return str(task_ctx.task_run.flow_run_id)
    flow_ctx = FlowRunContext.get()
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        return str(flow_ctx.flow_run.id)
    return None


def owned_by(labels: Mapping[str, str] | None, tenant: str) -> bool:
    """True when ``labels`` say this collection created the chat for ``tenant``.

    The sweeps re-check this on every listed chat: a server that ignored the label
    filter must still never make them touch someone else's chat.
    """
    if not labels:
        return False
    return all(labels.get(k) == v for k, v in scope_labels(tenant).items())


def workflow_of(labels: Mapping[str, str] | None) -> str | None:
    """The workflow id a chat's labels name, if any."""
    value = (labels or {}).get(LABEL_WORKFLOW)
    return value or None


def label_problems(labels: Mapping[str, str]) -> list[str]:
    """Every way ``labels`` break chatd's label rules (empty when valid)."""
    problems: list[str] = []
    if len(labels) > MAX_LABELS:
        problems.append(f"too many labels ({len(labels)} > {MAX_LABELS})")
    for key, value in labels.items():
        if not key or len(key.encode()) > MAX_KEY_BYTES or not _KEY_RE.match(key):
            problems.append(f"invalid label key {key!r}")
        if not isinstance(value, str) or not value or len(value.encode()) > MAX_VALUE_BYTES:
            problems.append(f"invalid value for label {key!r}")
    return problems

"""Every error prefect-coder raises, under one root: :class:`PrefectCoderError`.

``except PrefectCoderError`` catches the product's own failures (bad parameters, a
busy workflow, the fleet at its cap, the state store); the chatd client's errors
derive from :class:`coder_chat.errors.CoderError`. Each error says whether running
the same step again may succeed in one attribute, ``retryable``.
"""

from __future__ import annotations

from prefect_coder.blocks.credentials import InvalidCoderCredentialsError
from prefect_coder.blocks.errors import PrefectCoderError
from prefect_coder.blocks.state.errors import (
    LeaseLostError,
    LeaseUnavailableError,
    SchemaChangedError,
    SchemaVersionError,
    StateStoreConfigError,
    StateStoreError,
    StoreUnavailableError,
)
from prefect_coder.flows.common.errors import (
    ChatNotArchivedError,
    StructuredAnswerError,
    TurnSlotLostError,
    TurnSlotUnavailableError,
    WorkflowBusyError,
    WorkflowParameterError,
)
from prefect_coder.flows.common.result_write import ResultNotPersistedError

__all__ = [
    "ChatNotArchivedError",
    "InvalidCoderCredentialsError",
    "LeaseLostError",
    "LeaseUnavailableError",
    "PrefectCoderError",
    "ResultNotPersistedError",
    "SchemaChangedError",
    "SchemaVersionError",
    "StateStoreConfigError",
    "StateStoreError",
    "StoreUnavailableError",
    "StructuredAnswerError",
    "TurnSlotLostError",
    "TurnSlotUnavailableError",
    "WorkflowBusyError",
    "WorkflowParameterError",
]

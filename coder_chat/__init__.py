"""coder_chat: an asyncio client for Coder's chatd API (no Prefect imports).

Start with :class:`CoderAgent` (one chat session, one turn per ``generate``);
see ``docs/client.md``. :func:`stop_chat` brings any chat to rest.

This module exports the client. Recovery building blocks stay in their modules
(``coder_chat.history``: ``fetch_turn``, ``fetch_until``, ``marker_attempts``,
``recover_turn_result``; ``coder_chat.recovery``; ``coder_chat.core.*``), and
submodules import from submodules, never from this package (no import cycle).
"""

from coder_chat.agent import (
    AgentHooks,
    AgentTimings,
    ArchiveResult,
    ClientToolCall,
    CoderAgent,
    GenerateResult,
    InterruptResult,
    NoTurnToFollowError,
    StepResult,
    StructuredResult,
)
from coder_chat.core.usage import Usage
from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderChatError,
    CoderError,
    CoderRecoveryError,
    CoderStreamError,
    CoderTimeoutError,
    CoderTransportError,
)
from coder_chat.events import TransportEvent
from coder_chat.history import DynamicToolPart, TranscriptMessage, rehydrate
from coder_chat.rest import ChatClient
from coder_chat.settings import CoderSettings
from coder_chat.stop import StopResult, stop_chat
from coder_chat.stream import StreamOptions
from coder_chat.tools import (
    ClientTool,
    StructuredOutput,
    ToolContext,
    ToolOutcome,
    client_tool,
    structured_output,
)

__all__ = [
    "AgentHooks",
    "AgentTimings",
    "ArchiveResult",
    "ChatClient",
    "ClientTool",
    "ClientToolCall",
    "CoderAgent",
    "CoderAgentError",
    "CoderApiError",
    "CoderChatError",
    "CoderError",
    "CoderRecoveryError",
    "CoderSettings",
    "CoderStreamError",
    "CoderTimeoutError",
    "CoderTransportError",
    "DynamicToolPart",
    "GenerateResult",
    "InterruptResult",
    "NoTurnToFollowError",
    "StepResult",
    "StopResult",
    "StreamOptions",
    "StructuredOutput",
    "StructuredResult",
    "ToolContext",
    "ToolOutcome",
    "TranscriptMessage",
    "TransportEvent",
    "Usage",
    "client_tool",
    "rehydrate",
    "stop_chat",
    "structured_output",
]

"""coder_chat: an asyncio client for Coder's chatd API (no Prefect imports).

Start with :class:`CoderAgent` (one chat session, one turn per ``generate``);
see ``docs/client.md``.
"""

from coder_chat.agent import (
    AgentTimings,
    ArchiveResult,
    ClientToolCall,
    CoderAgent,
    GenerateResult,
    InterruptResult,
    StepResult,
    StructuredResult,
)
from coder_chat.core.usage import Usage
from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderChatError,
    CoderError,
    CoderStreamError,
    CoderTimeoutError,
    CoderTransportError,
)
from coder_chat.events import TransportEvent
from coder_chat.history import (
    DynamicToolPart,
    RecoveredTurn,
    TranscriptMessage,
    count_marker_attempts,
    fetch_turn,
    fetch_until,
    marker_attempts,
    recover_turn,
    rehydrate,
)
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
    "CoderSettings",
    "CoderStreamError",
    "CoderTimeoutError",
    "CoderTransportError",
    "DynamicToolPart",
    "GenerateResult",
    "InterruptResult",
    "RecoveredTurn",
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
    "count_marker_attempts",
    "fetch_turn",
    "fetch_until",
    "marker_attempts",
    "recover_turn",
    "rehydrate",
    "stop_chat",
    "structured_output",
]

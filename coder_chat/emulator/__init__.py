"""A faithful local chatd emulator (Coder chat API, current era); see docs/emulator.md.

It plays one of the server builds the wire spec pins (``era="b1"``, ``"b2"``, ``"b3"``).

Quick use::

    from coder_chat.emulator import Emulator, Script

    async with Emulator(era="b3") as emu:
        emu.base_url, emu.token, emu.organization_id
        emu.script_next_turn(chat_id, Script.structured_output({"answer": 42}))
        emu.faults.drop_stream(chat_id, after_frames=3)
"""

from .eras import DEFAULT_ERA, ERA_NAMES
from .script import (
    Failure,
    Reasoning,
    Script,
    ScriptedToolCall,
    ScriptStep,
    ServerToolCall,
    Sleep,
    Text,
    parse_directive,
)
from .server import Emulator, Faults

__all__ = [
    "DEFAULT_ERA",
    "ERA_NAMES",
    "Emulator",
    "Failure",
    "Faults",
    "Reasoning",
    "Script",
    "ScriptStep",
    "ScriptedToolCall",
    "ServerToolCall",
    "Sleep",
    "Text",
    "parse_directive",
]

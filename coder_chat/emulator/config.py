"""Emulator configuration: the knobs of one emulated deployment."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .eras import Era, default_era, era

DEFAULT_MODEL_CONFIG_ID = "00000000-0000-4000-8000-00000000c0de"
CONTEXT_LIMIT = 200_000


@dataclass
class Config:
    """Emulator knobs; defaults are the real server's where one exists."""

    requires_action_timeout: float = 300.0
    ping_interval: float = 15.0
    ping_timeout: float = 15.0
    queue_cap: int = 20
    delta_count: int = 5
    delta_delay: float = 0.005
    commit_delay: float = 0.0
    interrupt_wind_down: float = 0.02
    max_concurrent_root_chats: int | None = None
    clock: Callable[[], float] = time.time
    log_requests: bool = True
    max_event_log: int = 100_000
    # Newer builds stamp a promoted queue head with the id of the queue entry it came
    # from; older ones do not. Both exist in the field, so clients must handle both:
    # tests switch this off to exercise the content heuristic. None: the era's default.
    stamp_queued_message_id: bool | None = None
    # AI Gateway provider names → surface kind ("openai" | "anthropic"); None: both
    # default names (see aibridge.py).
    aibridge_providers: dict[str, str] | None = None
    # Which server build to play (see eras.py).
    era: Era = field(default_factory=lambda: era(default_era()))

    @property
    def stamps_queued_message_id(self) -> bool:
        """Whether a promoted queue head carries ``queued_message_id``."""
        if self.stamp_queued_message_id is None:
            return self.era.stamp_queued_message_id
        return self.stamp_queued_message_id

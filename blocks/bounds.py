"""Upper bounds of the product's durations, shared by every settings model.

Each duration and count a user sets (block fields, flow parameters) has a finite
upper bound, so a typo (``1e308``, ``inf``) is refused at the edge with the field
named — the Prefect form shows the bound — and is never persisted as a lease
expiry or a deadline.
"""

from __future__ import annotations

__all__ = ["DAY", "HOUR"]

HOUR = 3600.0
DAY = 86400.0

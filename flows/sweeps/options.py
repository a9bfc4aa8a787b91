"""Tuning of a sweep run: concurrency, paging, lease and interrupt/archive bounds."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from prefect_coder.blocks.bounds import HOUR

__all__ = ["SweepOptions"]


class SweepOptions(BaseModel):
    """Tuning of a sweep run (the defaults suit a production deployment)."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(default=8, ge=1, le=256, description="Chats acted on at once.")
    page_size: int = Field(default=200, ge=2, le=1000, description="Chats per listing page.")
    page_overlap: int = Field(
        default=5,
        ge=0,
        le=100,
        description=(
            "Chats each page re-reads of the previous one: the listing is ordered by "
            "updated_at, so chats archived meanwhile shift later ones forward."
        ),
    )
    lease_wait_s: float = Field(
        default=1.0,
        ge=0,
        le=HOUR,
        description="Wait for a workflow's lease before leaving it for later.",
    )
    lease_ttl_s: float = Field(
        default=60.0,
        gt=0,
        le=HOUR,
        description="Ttl of the lease a sweep holds.",
    )
    interrupt_bound_s: float = Field(
        default=15.0,
        gt=0,
        le=HOUR,
        description=(
            "Bound of stopping a run: interrupts, and polls until the chat is at rest "
            "(a 409 is fine)."
        ),
    )
    archive_settle_s: float = Field(
        default=15.0,
        gt=0,
        le=HOUR,
        description="Added to the stop bound of a chat to retire: its archive retries 409.",
    )
    archive_retry_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Pause between polls and archive retries.",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, le=HOUR, description="Bound of each REST call."
    )
    max_table_rows: int = Field(
        default=500,
        ge=1,
        le=100_000,
        description="Rows of the table artifact (the rest are counted).",
    )
    include_archived: bool = Field(
        default=True,
        description=(
            "The orphan sweep also lists archived chats (to settle stranded records of "
            "chats archived elsewhere). Off: stranded chats are looked up one by one."
        ),
    )
    emit_events: bool = Field(
        default=True, description="Emit a Prefect event per chat acted on (and per run)."
    )

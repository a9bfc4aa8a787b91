"""The logger of code that runs both inside and outside a Prefect run, and its clock."""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect.context import FlowRunContext
from prefect.logging import get_run_logger

__all__ = ["RunLogger", "run_logger", "run_started_at"]

#: What :func:`run_logger` returns: Prefect's run adapter or a plain logger.
RunLogger = logging.Logger | logging.LoggerAdapter[Any]


def run_logger(fallback: str) -> RunLogger:
    """The current flow or task run's logger, so the lines show in the run's logs in
    the UI; outside any run (tests, failure hooks, plain scripts) the module logger
    named ``fallback``."""
    try:
        return get_run_logger()
    except Exception:
        return logging.getLogger(fallback)


def run_started_at() -> float:
    """Wall-clock time (``time.time()``) the current flow run started: its
    ``start_time`` (set by the server when it went Running), else when its run
    context was entered; outside a flow run, now."""
    ctx = FlowRunContext.get()
    if ctx is None:
        return time.time()
    started = ctx.flow_run.start_time if ctx.flow_run is not None else None
    return float((started or ctx.start_time).timestamp())

"""The logger of code that runs both inside and outside a Prefect run."""

from __future__ import annotations

import logging
from typing import Any

from prefect.logging import get_run_logger

__all__ = ["RunLogger", "run_logger"]

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

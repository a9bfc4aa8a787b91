"""Constants and the Prefect environment of the crash-recovery tests.

A module of its own (not the conftest): test files import it by a unique name, so
they never pick up another directory's ``conftest`` module by accident.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

TOKEN = f"tok-recovery-{uuid.uuid4().hex}-SECRET"
#: Short recovery constants for tests (production: 1 s poll, horizon = request timeout).
FAST_ENV = {"PREFECT_CODER_SETTLE_POLL_S": "0.05", "PREFECT_CODER_COMMIT_HORIZON_S": "1.0"}


@dataclass(frozen=True)
class PrefectEnv:
    api_url: str
    results_dir: Path

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(self.results_dir),
            PREFECT_LOGGING_LEVEL="WARNING",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH")) if p
            ),
            **FAST_ENV,
        )
        env.update(extra)
        return env

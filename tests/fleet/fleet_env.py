"""Constants of the fleet tests, importable by a unique module name
(test files must not import another directory's ``conftest`` by accident)."""

from __future__ import annotations

import uuid
from pathlib import Path

TOKEN = f"tok-fleet-{uuid.uuid4().hex}-SECRET"
ROOT = Path(__file__).resolve().parents[2]

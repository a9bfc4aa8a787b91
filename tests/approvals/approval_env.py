"""Constants of the approvals tests, importable by a unique module name
(test files must not import another directory's ``conftest`` by accident)."""

from __future__ import annotations

import uuid

TOKEN = f"tok-approval-{uuid.uuid4().hex}-SECRET"

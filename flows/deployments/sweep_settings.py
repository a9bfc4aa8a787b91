"""SweepSettings: the part of WorkflowSettings a sweep uses, so a sweep deployment's
form shows only sweep settings (no Keep Chat, Retries or per-turn artifacts).

Backward compatible: a run's ``settings`` written for the workflows (the shared
``&settings`` anchor of prefect.yaml, or a ``WorkflowSettings`` object from Python)
still validates; the turn-only keys are ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from prefect_coder.flows.common.params import WorkflowSettings

__all__ = ["SweepSettings"]


def _same(name: str) -> Any:
    # The workflows' own field (default, bounds, description): one definition.
    return WorkflowSettings.model_fields[name]


class SweepSettings(BaseModel):
    """How a sweep reaches Coder and the state store, and the bounds it derives from."""

    # extra="ignore", unlike WorkflowSettings: existing deployments pass the
    # workflows' settings here, and their turn-only keys mean nothing to a sweep.
    model_config = ConfigDict(extra="ignore")

    credentials_block: str | None = _same("credentials_block")
    store_block: str | None = _same("store_block")
    turn_timeout_s: float | None = _same("turn_timeout_s")
    lease_wait_s: float = _same("lease_wait_s")
    lease_ttl_s: float = _same("lease_ttl_s")
    tool_modules: list[str] = _same("tool_modules")

    @model_validator(mode="before")
    @classmethod
    def _from_workflow_settings(cls, data: Any) -> Any:
        if isinstance(data, WorkflowSettings):
            return data.model_dump()
        return data

    def workflow_settings(self) -> WorkflowSettings:
        """These settings as the WorkflowSettings the sweep's building blocks take."""
        return WorkflowSettings(**self.model_dump())

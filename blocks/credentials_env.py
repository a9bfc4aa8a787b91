"""Read Coder credentials from the environment (``CODER_*``) with pydantic-settings.

Prefers the client's own ``coder_chat.settings.CoderSettings`` so both read the
same variables the same way; ``CODER_TURN_TIMEOUT`` is block-only.
"""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class _TurnEnv(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CODER_", extra="ignore")

    turn_timeout: float | None = None


class _FallbackCoderEnv(BaseSettings):
    """Used only if ``coder_chat.settings`` is unavailable."""

    model_config = SettingsConfigDict(env_prefix="CODER_", extra="ignore")

    url: str | None = None
    session_token: SecretStr | None = None
    org_id: str | None = None
    http_timeout: float = 30.0
    request_timeout: float | None = None
    verify_tls: bool = True


def read_coder_env() -> dict[str, Any]:
    """CoderCredentials fields found in the environment (unset variables are omitted)."""
    try:
        from coder_chat.settings import CoderSettings

        env: Any = CoderSettings()
    except ImportError:
        env = _FallbackCoderEnv()
    out: dict[str, Any] = {
        "base_url": env.url,
        "token": env.session_token,
        "organization_id": env.org_id,
        "http_timeout": env.http_timeout,
        "request_timeout": env.request_timeout,
        "verify_tls": env.verify_tls,
        "turn_timeout": _TurnEnv().turn_timeout,
    }
    return {k: v for k, v in out.items() if v is not None}


ENV_NAMES = {
    "base_url": "CODER_URL",
    "token": "CODER_SESSION_TOKEN",
    "organization_id": "CODER_ORG_ID",
}

"""Environment configuration of the chatd client (pydantic-settings).

===========================  =====================================================
``CODER_URL``                deployment base URL, e.g. ``https://coder.example.com``
``CODER_SESSION_TOKEN``      session token (kept in a ``SecretStr``)
``CODER_ORG_ID``             organization id used to create chats / upload files
``CODER_HTTP_TIMEOUT``       default per-request REST timeout, seconds (30)
``CODER_REQUEST_TIMEOUT``    per-segment budget of a turn, seconds (unset = none)
``CODER_VERIFY_TLS``         TLS certificate verification (true)
===========================  =====================================================
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["CoderSettings"]


class CoderSettings(BaseSettings):
    """Client settings read from ``CODER_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="CODER_", extra="ignore")

    url: str | None = None
    session_token: SecretStr | None = None
    org_id: str | None = Field(default=None)
    http_timeout: float = 30.0
    request_timeout: float | None = None
    verify_tls: bool = True

    @property
    def organization_id(self) -> str | None:
        return self.org_id

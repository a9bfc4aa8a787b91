"""The ``CoderCredentials`` Prefect block: where to reach Coder, as whom, how patiently."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, ValidationError, field_validator

from .bounds import DAY, HOUR
from .credentials_env import ENV_NAMES, read_coder_env
from .errors import PrefectCoderError

if TYPE_CHECKING:
    from prefect.client.schemas.objects import BlockDocument

    from coder_chat.agent import CoderAgent
    from coder_chat.rest import ChatClient


class InvalidCoderCredentialsError(PrefectCoderError, RuntimeError):
    """A saved ``CoderCredentials`` block holds values the block rejects (e.g. a
    ``base_url`` saved through the REST API or an older UI form with an ``ftp://``
    scheme). The message names each field and its fix, never the rejected value.

    A ``RuntimeError`` like the generic one Prefect raises in its place (code that
    caught that keeps working); not a ``ValueError``, which ``Block.load`` callers
    read as "no block of that name".
    """

    def __init__(self, block_name: str, problems: str) -> None:
        self.block_name = block_name
        #: ``field: what to do`` for each rejected field, ``; ``-separated.
        self.problems = problems
        super().__init__(
            f"CoderCredentials block {block_name!r} is invalid: {problems}. Fix it in the "
            f"Prefect UI (Blocks → {block_name} → Edit) or save it again with "
            f"CoderCredentials(...).save({block_name!r}, overwrite=True)."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.block_name, self.problems))


class CoderCredentials(Block):
    """Credentials and time budgets for Coder Agents (chatd): the deployment URL, the
    organization, a session token (kept secret), and the per-segment, per-turn and
    per-request timeouts that bound every durable step.

    Example:
        Load saved credentials and run one turn:
        ```python
        from prefect_coder.blocks import CoderCredentials

        coder_credentials = CoderCredentials.load("BLOCK_NAME")
        agent = coder_credentials.get_agent(chat_id=checkpoint.chat_id)
        result = await agent.generate(prompt, timeout=coder_credentials.turn_timeout)
        ```

        Build them from CODER_URL / CODER_SESSION_TOKEN / CODER_ORG_ID:
        ```python
        from prefect_coder.blocks import CoderCredentials

        CoderCredentials.from_env().save("coder")
        ```
    """

    # A rejected value may be the token itself: never echo inputs in validation errors.
    model_config = ConfigDict(hide_input_in_errors=True)

    _block_type_name = "Coder Credentials"
    _block_type_slug = "coder-credentials"
    _logo_url = "https://github.com/coder.png?size=200"  # type: ignore[assignment]
    _documentation_url = "https://coder.com/docs"  # type: ignore[assignment]
    _description = (
        "Coder deployment URL, organization, session token and timeouts for Coder Agents "
        "chat workflows."
    )

    base_url: str = Field(
        title="Coder URL",
        description="The Coder deployment's base URL, e.g. https://coder.example.com.",
    )
    organization_id: uuid.UUID = Field(
        title="Organization ID",
        description="UUID of the Coder organization chats are created in.",
    )
    token: SecretStr = Field(
        title="Session token",
        description="A Coder session token (e.g. from `coder tokens create`); never logged.",
    )
    request_timeout: float = Field(
        default=300.0,
        gt=0,
        le=DAY,
        description="Seconds one turn segment (REST phase, stream and redials) may take.",
    )
    turn_timeout: float = Field(
        default=600.0,
        gt=0,
        le=DAY,
        description="Seconds a whole turn (every segment of a tool loop) may take.",
    )
    http_timeout: float = Field(
        default=30.0,
        gt=0,
        le=HOUR,
        description="Seconds a single REST call may take.",
    )
    verify_tls: bool = Field(
        default=True,
        description="Verify the deployment's TLS certificate (turn off only for test servers).",
    )
    max_concurrent_turns: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        title="Max concurrent turns",
        description=(
            "Deployment-wide cap on agent turns running at once, across every worker "
            "(empty: no cap). Keep it within the deployment's chat capacity (5 root chats "
            "by default)."
        ),
    )
    turn_slot_wait: float = Field(
        default=600.0,
        gt=0,
        le=DAY,
        description="Seconds a turn waits for a free turn slot before it fails.",
    )
    turn_slot_ttl: float = Field(
        default=60.0,
        gt=0,
        le=HOUR,
        description=(
            "Seconds after its holder's last renewal that a turn slot lapses (the slot "
            "lease's lifetime). A lapsed slot is taken by another turn once the dead "
            "holder's turn is at rest on the Coder server (the cap counts server-side "
            "turns), or at once when the server cannot be asked."
        ),
    )
    store_block: str | None = Field(
        default=None,
        max_length=255,
        title="State store block",
        description=(
            "Name of the ChatStateStore block that every deployment using these "
            "credentials keeps its state in — workflows, recover-turn, the sweeps and the "
            "reconciler — so that none of them can look at another store. Empty: the local "
            "SQLite default (one machine only). A run's settings.store_block may repeat it "
            "but not name another."
        ),
    )
    ai_gateway_openai_provider: str = Field(
        default="openai",
        title="AI Gateway OpenAI provider",
        description="AI Gateway provider name of the OpenAI-compatible surface.",
    )
    ai_gateway_anthropic_provider: str = Field(
        default="anthropic",
        title="AI Gateway Anthropic provider",
        description="AI Gateway provider name of the Anthropic-compatible surface.",
    )
    ai_gateway_upstream_key: SecretStr | None = Field(
        default=None,
        title="AI Gateway upstream key (BYOK)",
        description=(
            "Bring-your-own-key mode: the upstream provider key, sent as the API key while "
            "the session token travels in X-Coder-AI-Governance-Token; never logged."
        ),
    )

    @field_validator("base_url", mode="before")
    @classmethod
    def _normalise_base_url(cls, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(
                "base_url: required; set it to your deployment's URL, e.g. "
                "https://coder.example.com (or CODER_URL for from_env())"
            )
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "base_url: must be an http(s) URL with a host, e.g. https://coder.example.com"
            )
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "base_url: must not contain user info; put the session token in `token`"
            )
        if parts.query or parts.fragment:
            raise ValueError(
                "base_url: must not have a query or fragment; give only scheme, host and path"
            )
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ValueError("base_url: the port is not a number in 1-65535") from None
        return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))

    @field_validator("organization_id", mode="before")
    @classmethod
    def _check_org(cls, value: Any) -> Any:
        if isinstance(value, uuid.UUID):
            return value
        try:
            return uuid.UUID(str(value).strip())
        except ValueError:
            raise ValueError(
                "organization_id: must be the organization's UUID, e.g. "
                "0a1b2c3d-0000-4000-8000-123456789abc (see `coder organizations show`)"
            ) from None

    @field_validator("token")
    @classmethod
    def _check_token(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value()
        if not raw.strip():
            raise ValueError(
                "token: empty; set a Coder session token (`coder tokens create`, or "
                "CODER_SESSION_TOKEN for from_env())"
            )
        if raw != raw.strip() or any(c in raw for c in "\r\n\t "):
            raise ValueError(
                "token: contains whitespace; paste the token without spaces or newlines"
            )
        return value

    # --- loading --------------------------------------------------------------------------

    @classmethod
    def _load_from_block_document(
        cls, block_document: BlockDocument, validate: bool = True
    ) -> CoderCredentials:
        # Every load path (load, aload, load_from_ref, a nested block) ends here. Prefect
        # turns a failed validation into "Unable to load ... try validate=False", which
        # names neither the field nor the fix: the run would fail far from the cause.
        try:
            return super()._load_from_block_document(block_document, validate=validate)
        except RuntimeError as exc:
            cause = exc.__cause__
            if not isinstance(cause, ValidationError):
                raise
            problems = "; ".join(_describe(e) for e in cause.errors())
            raise InvalidCoderCredentialsError(
                block_document.name or "(anonymous)", problems
            ) from cause

    # --- factories ---------------------------------------------------------------------------

    @classmethod
    def from_env(cls, **overrides: Any) -> CoderCredentials:
        """Credentials from CODER_URL, CODER_SESSION_TOKEN, CODER_ORG_ID (and the optional
        CODER_HTTP_TIMEOUT, CODER_REQUEST_TIMEOUT, CODER_TURN_TIMEOUT, CODER_VERIFY_TLS);
        keyword arguments win over the environment.
        """
        values = {**read_coder_env(), **overrides}
        missing = [ENV_NAMES[f] for f in ENV_NAMES if values.get(f) is None]
        if missing:
            raise ValueError(
                f"CoderCredentials.from_env: set {', '.join(missing)} in the environment "
                "(or pass them as keyword arguments)"
            )
        try:
            return cls(**values)
        except ValidationError as exc:
            # Re-raise with env names so the fix is obvious; the input is never echoed.
            msgs = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            raise ValueError(f"CoderCredentials.from_env: {msgs}") from None

    def get_client(self, **kwargs: Any) -> ChatClient:
        """A new ``coder_chat.rest.ChatClient`` (yours to close: ``async with`` it).

        Keyword arguments (``on_transport_event``, ``http_client``, ...) go to the client.
        """
        from coder_chat.rest import ChatClient

        return ChatClient(
            self.base_url,
            self.token,
            organization_id=str(self.organization_id),
            timeout=self.http_timeout,
            verify=self.verify_tls,
            **kwargs,
        )

    def get_agent(self, **kwargs: Any) -> CoderAgent:
        """A ``coder_chat.agent.CoderAgent`` with these credentials and ``request_timeout``.

        Keyword arguments go to the agent (``chat_id``, ``last_seen_message_id``,
        ``tools``, ...). Unless you pass ``client=``, a new client is built for it; the
        agent does not close a client it was given, so close both:
        ``await agent.aclose(); await agent.client.aclose()`` — or use
        ``async with creds.open_agent(...) as agent`` which does that for you.
        Bound the whole turn with ``agent.generate(..., timeout=creds.turn_timeout)``.
        """
        from coder_chat.agent import CoderAgent

        if kwargs.get("client") is None:
            kwargs["client"] = self.get_client(on_transport_event=kwargs.get("on_transport_event"))
        kwargs.setdefault("request_timeout", self.request_timeout)
        return CoderAgent(**kwargs)

    @asynccontextmanager
    async def open_agent(self, **kwargs: Any) -> AsyncIterator[CoderAgent]:
        """``get_agent(**kwargs)`` that closes the agent and its client on exit (never archives)."""
        owned = kwargs.get("client") is None
        agent = self.get_agent(**kwargs)
        try:
            yield agent
        finally:
            try:
                await agent.aclose()
            finally:
                if owned:
                    await agent.client.aclose()


def _describe(error: Any) -> str:
    """``field: what to do`` for one pydantic error (never the rejected input)."""
    field = ".".join(str(p) for p in error.get("loc", ())) or "value"
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return msg if msg.startswith(f"{field}:") else f"{field}: {msg}"

# The per-call `timeout=` parameter mirrors ChatClient's contract.
# ruff: noqa: ASYNC109
"""AI Gateway client: model-only calls (no chat, no workspace, no cleanup).

Coder's AI Gateway (AI Bridge) proxies two provider surfaces under the deployment:

* OpenAI-compatible: ``POST {base}/api/v2/aibridge/{provider}/v1/chat/completions``
* Anthropic-compatible: ``POST {base}/api/v2/aibridge/{provider}/v1/messages``

Auth: the Coder session token as the provider API key (``Authorization: Bearer``
on the OpenAI surface, ``x-api-key`` on the Anthropic one). In bring-your-own-key
mode the upstream key takes that place and the Coder token travels in
``X-Coder-AI-Governance-Token``.

:meth:`GatewayClient.structured` asks for JSON matching a pydantic model (OpenAI:
``response_format`` ``json_schema``; Anthropic: one forced tool whose
``input_schema`` is the schema), validates it, re-asks once with the validation
errors on invalid output and raises :class:`GatewayOutputError` after a second
invalid answer.

Errors: :class:`GatewayAuthError` (401/403), :class:`GatewayRateLimitError` (429),
:class:`GatewayServerError` (5xx), :class:`GatewayError` (other non-2xx). None of
them, nor any log line, contains the token or the upstream key: they are built
from the status, the path and the server's message only.

No Prefect import: usable from any asyncio program. It shares the ``httpx``
client of a :class:`~coder_chat.rest.ChatClient` (one pool per process).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import BaseModel, SecretStr, ValidationError

from coder_chat.errors import CoderAgentError

__all__ = [
    "GatewayAuthError",
    "GatewayClient",
    "GatewayError",
    "GatewayOutputError",
    "GatewayRateLimitError",
    "GatewayReply",
    "GatewayServerError",
    "StructuredReply",
]

Api = Literal["openai", "anthropic"]
M = TypeVar("M", bound=BaseModel)
GOVERNANCE_HEADER = "X-Coder-AI-Governance-Token"
ANTHROPIC_VERSION = "2023-06-01"
_TOOL_NAME = "structured_output"


class GatewayError(CoderAgentError):
    """A non-2xx answer of the AI Gateway (or a transport failure reaching it)."""

    retryable = False

    def __init__(self, status: int, path: str, message: str) -> None:
        self.status = status
        self.path = path
        self.message = message
        super().__init__(f"AI Gateway POST {path} failed ({status}): {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.path, self.message))


class GatewayAuthError(GatewayError):
    """401/403: the token (or the BYOK key) was refused. Not retryable."""


class GatewayRateLimitError(GatewayError):
    """429: the gateway or the provider is rate limiting. Retryable after a pause."""

    retryable = True


class GatewayServerError(GatewayError):
    """5xx, a timeout or a lost connection. Retryable."""

    retryable = True


class GatewayOutputError(CoderAgentError):
    """The model's answer did not match the schema, twice (after one re-ask)."""

    def __init__(self, model_name: str, errors: str, raw: str) -> None:
        self.model_name = model_name
        self.errors = errors
        self.raw = raw
        super().__init__(
            f"the model's answer did not match {model_name} after one re-ask: {errors}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model_name, self.errors, self.raw))


@dataclass(frozen=True)
class GatewayReply:
    """One completion: its text (or tool input as JSON text), usage and timing."""

    text: str
    model: str | None
    finish_reason: str | None
    usage: dict[str, Any] = field(default_factory=dict)
    duration_ms: float = 0.0


@dataclass(frozen=True)
class StructuredReply(Generic[M]):
    """A validated structured answer and how it was reached."""

    value: M
    raw: str
    attempts: int
    usage: dict[str, Any]
    model: str | None
    duration_ms: float


def _message_of(body: bytes, reason: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return reason or "error"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:500]
        if isinstance(data.get("message"), str):
            detail = data.get("detail")
            text = str(data["message"])
            return (f"{text} — {detail}" if isinstance(detail, str) and detail else text)[:500]
    return reason or "error"


def _error_for(status: int, path: str, message: str) -> GatewayError:
    if status in (401, 403):
        return GatewayAuthError(status, path, message)
    if status == 429:
        return GatewayRateLimitError(status, path, message)
    if status >= 500:
        return GatewayServerError(status, path, message)
    return GatewayError(status, path, message)


def _usage(api: Api, data: Mapping[str, Any]) -> dict[str, Any]:
    usage = data.get("usage") or {}
    if not isinstance(usage, Mapping):
        return {}
    if api == "openai":
        return {
            "input_tokens": usage.get("prompt_tokens"),
            "output_tokens": usage.get("completion_tokens"),
        }
    return {"input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens")}


def _add_usage(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, int):
            out[k] = int(out.get(k) or 0) + v
    return out


class GatewayClient:
    """Calls the AI Gateway's provider surfaces of one Coder deployment.

    Args:
        base_url: the Coder deployment URL.
        token: the Coder session token (kept secret).
        http_client: an ``httpx.AsyncClient`` to share (e.g. a ChatClient's); it
            carries no auth of its own. Without one the client owns a new one.
        upstream_key: bring-your-own-key mode: the provider key.
        openai_provider / anthropic_provider: the gateway's provider names.
        timeout: seconds per request.
    """

    def __init__(
        self,
        base_url: str,
        token: SecretStr | str,
        *,
        http_client: httpx.AsyncClient | None = None,
        upstream_key: SecretStr | str | None = None,
        openai_provider: str = "openai",
        anthropic_provider: str = "anthropic",
        timeout: float = 120.0,
    ) -> None:
        secret = token if isinstance(token, SecretStr) else SecretStr(token or "")
        if not secret.get_secret_value():
            raise CoderAgentError("a Coder session token is required")
        if isinstance(upstream_key, str):
            upstream_key = SecretStr(upstream_key) if upstream_key else None
        for name, value in (
            ("openai_provider", openai_provider),
            ("anthropic_provider", anthropic_provider),
        ):
            if not value or "/" in value or value != value.strip():
                raise CoderAgentError(f"{name}: a provider name without '/' or spaces")
        self._base_url = base_url.rstrip("/")
        self._token = secret
        self._upstream = upstream_key
        self._providers: dict[Api, str] = {
            "openai": openai_provider,
            "anthropic": anthropic_provider,
        }
        self._timeout = timeout
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=timeout, follow_redirects=False)

    @classmethod
    def from_chat_client(cls, client: Any, token: SecretStr | str, **kwargs: Any) -> GatewayClient:
        """A gateway client on the same connection pool as a ``ChatClient``."""
        # The pool is the ChatClient's private attribute by design (one owner); the
        # gateway only borrows it and never closes it.
        return cls(client.base_url, token, http_client=client._http, **kwargs)

    def __repr__(self) -> str:
        mode = "byok" if self._upstream is not None else "coder-token"
        return f"GatewayClient(base_url={self._base_url!r}, auth={mode})"

    async def aclose(self) -> None:
        """Close the pool if this client owns it."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- requests

    def path(self, api: Api) -> str:
        """The surface's path (no host): what errors and logs name."""
        provider = self._providers[api]
        tail = "chat/completions" if api == "openai" else "messages"
        return f"/api/v2/aibridge/{provider}/v1/{tail}"

    def _headers(self, api: Api) -> dict[str, str]:
        key = (self._upstream or self._token).get_secret_value()
        headers = {"Accept": "application/json"}
        if api == "openai":
            headers["Authorization"] = f"Bearer {key}"
        else:
            headers["x-api-key"] = key
            headers["anthropic-version"] = ANTHROPIC_VERSION
        if self._upstream is not None:
            headers[GOVERNANCE_HEADER] = self._token.get_secret_value()
        return headers

    async def post(self, api: Api, body: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        """POST one request body to a surface; the parsed JSON answer or a typed error."""
        path = self.path(api)
        failure: GatewayError | None = None
        try:
            response = await self._http.post(
                self._base_url + path,
                json=dict(body),
                headers=self._headers(api),
                timeout=timeout or self._timeout,
            )
        except httpx.TimeoutException as exc:
            failure = GatewayServerError(0, path, f"timed out ({type(exc).__name__})")
        except httpx.TransportError as exc:
            # The httpx exception holds the request (and its auth headers): keep only a name.
            failure = GatewayServerError(0, path, f"connection failed ({type(exc).__name__})")
        if failure is not None:
            raise failure
        if not 200 <= response.status_code < 300:
            raise _error_for(
                response.status_code, path, _message_of(response.content, response.reason_phrase)
            )
        try:
            return response.json()
        except ValueError:
            raise GatewayServerError(response.status_code, path, "answer is not JSON") from None

    async def complete(
        self,
        api: Api,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        system: str | None = None,
        schema: tuple[str, dict[str, Any]] | None = None,
        max_tokens: int = 4096,
        timeout: float | None = None,
    ) -> GatewayReply:
        """One completion. ``messages`` are ``{"role": "user"|"assistant", "content": str}``.

        With ``schema`` (name, JSON schema) the answer is asked for as JSON of that
        schema; the reply's ``text`` is then the JSON text (Anthropic: the forced
        tool's input, re-serialised).
        """
        started = time.perf_counter()
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
        if api == "openai":
            msgs = [{"role": "system", "content": system}] if system else []
            body["messages"] = msgs + [dict(m) for m in messages]
            if schema is not None:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": schema[0], "schema": schema[1], "strict": True},
                }
        else:
            body["messages"] = [dict(m) for m in messages]
            if system:
                body["system"] = system
            if schema is not None:
                body["tools"] = [
                    {
                        "name": _TOOL_NAME,
                        "description": f"Return the answer as {schema[0]}.",
                        "input_schema": schema[1],
                    }
                ]
                body["tool_choice"] = {"type": "tool", "name": _TOOL_NAME}
        data = await self.post(api, body, timeout=timeout)
        text, finish = _extract(api, data, self.path(api))
        return GatewayReply(
            text=text,
            model=data.get("model") if isinstance(data, dict) else None,
            finish_reason=finish,
            usage=_usage(api, data) if isinstance(data, dict) else {},
            duration_ms=round((time.perf_counter() - started) * 1000, 2),
        )

    async def structured(
        self,
        api: Api,
        model: str,
        prompt: str,
        output: type[M],
        *,
        system: str | None = None,
        max_tokens: int = 4096,
        timeout: float | None = None,
    ) -> StructuredReply[M]:
        """Ask for an ``output`` instance; one re-ask on invalid output, then
        :class:`GatewayOutputError`."""
        started = time.perf_counter()
        schema = (output.__name__, output.model_json_schema())
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        usage: dict[str, Any] = {}
        reply: GatewayReply | None = None
        errors = ""
        for attempt in (1, 2):
            reply = await self.complete(
                api,
                model,
                messages,
                system=system,
                schema=schema,
                max_tokens=max_tokens,
                timeout=timeout,
            )
            usage = _add_usage(usage, reply.usage)
            try:
                value = output.model_validate_json(reply.text)
            except ValidationError as exc:
                errors = _short_errors(exc)
            else:
                return StructuredReply(
                    value=value,
                    raw=reply.text,
                    attempts=attempt,
                    usage=usage,
                    model=reply.model,
                    duration_ms=round((time.perf_counter() - started) * 1000, 2),
                )
            messages += [
                {"role": "assistant", "content": reply.text},
                {
                    "role": "user",
                    "content": (
                        f"That answer is not valid {schema[0]} JSON ({errors}). Answer again "
                        "with only a JSON object that matches the schema."
                    ),
                },
            ]
        assert reply is not None
        raise GatewayOutputError(schema[0], errors, reply.text[:2000])


def _short_errors(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def _extract(api: Api, data: Any, path: str) -> tuple[str, str | None]:
    """The answer text of a completion (or the forced tool's input as JSON)."""
    try:
        if api == "openai":
            choice = data["choices"][0]
            return str(choice["message"].get("content") or ""), choice.get("finish_reason")
        blocks = data["content"]
        for block in blocks:
            if block.get("type") == "tool_use":
                return json.dumps(block.get("input")), data.get("stop_reason")
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        return text, data.get("stop_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise GatewayServerError(200, path, "answer has an unexpected shape") from None

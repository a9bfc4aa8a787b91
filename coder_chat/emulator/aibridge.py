"""The AI Gateway (AI Bridge) surfaces of the emulated deployment.

* ``POST /api/v2/aibridge/{provider}/v1/chat/completions`` (OpenAI-compatible)
* ``POST /api/v2/aibridge/{provider}/v1/messages`` (Anthropic-compatible)

``provider`` must be one of ``Config.aibridge_providers`` (name → ``openai`` |
``anthropic``; default ``openai`` and ``anthropic``); a surface of the other
kind answers 404. Auth: the Coder token as the provider key (``Authorization:
Bearer`` or ``x-api-key``), or BYOK: any non-empty key plus the Coder token in
``X-Coder-AI-Governance-Token``. Anything else is 401 with Coder's envelope.

The model is deterministic. With a JSON schema (OpenAI ``response_format``
``json_schema``; Anthropic a forced tool's ``input_schema``) it answers a value
built from the schema (defaults first, enums' first value, strings derived from
the prompt); otherwise ``Echo: <last user text>``. A ``#gw {json}`` directive in
a user message scripts it:

* ``{"invalid": N}`` — the first N answers of the conversation (counted by the
  assistant messages the request carries, so a re-ask is answer 2) are invalid:
  not JSON on the OpenAI surface, a schema-violating object on the Anthropic one;
* ``{"reply": <value>}`` — answer exactly this (objects are sent as JSON);
* ``{"usage": {"input_tokens": i, "output_tokens": o}}``.

Faults come from the REST fault API like every route (``fail-rest`` with
``path="/aibridge/"`` for 401/429/5xx). Every call is logged as an ``aibridge``
event (provider, api, model, byok, status, answer index) — never a key.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from .core import Core
from .httpserver import Request, Response, error_response, json_response

PREFIX = "/api/v2/aibridge/"
DEFAULT_PROVIDERS = {"openai": "openai", "anthropic": "anthropic"}
SIGNED_OUT = "You are signed out or your session has expired. Please sign in again to continue."
_DIRECTIVE = re.compile(r"#gw\s+(\{.*\})\s*$", re.S)


def handles(path: str) -> bool:
    """Whether ``path`` belongs to the AI Gateway."""
    return path.startswith(PREFIX)


def _providers(core: Core) -> dict[str, str]:
    return getattr(core.cfg, "aibridge_providers", None) or DEFAULT_PROVIDERS


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _auth(core: Core, req: Request, api: str) -> tuple[bool, Response | None]:
    bearer = req.header("authorization") or ""
    key = bearer[7:].strip() if bearer.lower().startswith("bearer ") else ""
    if api == "anthropic" and not key:
        key = (req.header("x-api-key") or "").strip()
    governance = (req.header("x-coder-ai-governance-token") or "").strip()
    if governance:
        if governance in core.users_by_token and key:
            return True, None
        return True, error_response(401, SIGNED_OUT, "API key is invalid.")
    if not key:
        return False, error_response(
            401, SIGNED_OUT, 'Cookie "coder_session_token" or query parameter must be provided.'
        )
    if key not in core.users_by_token:
        return False, error_response(401, SIGNED_OUT, "API key is invalid.")
    return False, None


def handle(core: Core, req: Request, path: str) -> Response:
    """Serve one AI Gateway request."""
    rest = path[len(PREFIX) :].split("/")
    if len(rest) < 3 or rest[1] != "v1":
        return error_response(404, "Route not found.")
    provider, tail = rest[0], "/".join(rest[2:])
    kind = _providers(core).get(provider)
    api = {"chat/completions": "openai", "messages": "anthropic"}.get(tail)
    if kind is None or api is None or kind != api:
        return error_response(404, "Route not found.")
    if req.method != "POST":
        return error_response(405, "Method not allowed.")
    byok, refused = _auth(core, req, api)
    if refused is not None:
        core.log("aibridge", None, provider=provider, api=api, byok=byok, status=401)
        return refused
    try:
        body = json.loads(req.body or b"null")
    except ValueError:
        return error_response(400, "Request body must be valid JSON.")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        return error_response(400, "Invalid request.", "model: required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return error_response(400, "Invalid request.", "messages: at least one is required")
    users = [
        _text_of(m.get("content"))
        for m in messages
        if isinstance(m, dict) and m.get("role") == "user"
    ]
    answered = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    directive: dict[str, Any] = {}
    for text in users:
        found = _DIRECTIVE.search(text)
        if found:
            try:
                parsed = json.loads(found.group(1))
            except ValueError:
                return error_response(400, "Invalid request.", "malformed #gw directive")
            if isinstance(parsed, dict):
                directive = parsed
    prompt = _DIRECTIVE.sub("", users[-1] if users else "").strip()
    schema = _schema_of(api, body)
    invalid = answered < int(directive.get("invalid", 0))
    if "reply" in directive and not invalid:
        reply = directive["reply"]
        value: Any = reply
    elif schema is not None:
        value = _invalid_value(schema) if invalid else _value_for(schema, prompt, schema)
    else:
        value = f"Echo: {prompt}" if prompt else "Echo: (no text)"
    usage = directive.get("usage") or {
        "input_tokens": sum(len(t) for t in users) // 4 + 1,
        "output_tokens": len(json.dumps(value)) // 4 + 1,
    }
    core.log(
        "aibridge",
        None,
        provider=provider,
        api=api,
        model=body["model"],
        byok=byok,
        status=200,
        answer=answered + 1,
        schema=schema is not None,
        invalid=invalid,
    )
    if api == "openai":
        if invalid and schema is not None:
            content = "Sure! Here is the answer you asked for (not JSON)."
        elif isinstance(value, str):
            content = value
        else:
            content = json.dumps(value)
        return json_response(
            200,
            {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": usage.get("input_tokens", 0),
                    "completion_tokens": usage.get("output_tokens", 0),
                    "total_tokens": usage.get("input_tokens", 0) + usage.get("output_tokens", 0),
                },
            },
        )
    if schema is not None:
        tool = _forced_tool(body) or "structured_output"
        block: dict[str, Any] = {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": tool,
            "input": value if isinstance(value, dict) else {"value": value},
        }
        stop = "tool_use"
    else:
        block = {"type": "text", "text": value if isinstance(value, str) else json.dumps(value)}
        stop = "end_turn"
    return json_response(
        200,
        {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [block],
            "stop_reason": stop,
            "usage": {
                "input_tokens": usage.get("input_tokens", 0),
                "output_tokens": usage.get("output_tokens", 0),
            },
        },
    )


def _forced_tool(body: dict[str, Any]) -> str | None:
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "tool":
        return str(choice.get("name"))
    return None


def _schema_of(api: str, body: dict[str, Any]) -> dict[str, Any] | None:
    if api == "openai":
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            js = fmt.get("json_schema")
            if isinstance(js, dict) and isinstance(js.get("schema"), dict):
                return dict(js["schema"])
        return None
    name = _forced_tool(body)
    for tool in body.get("tools") or []:
        if isinstance(tool, dict) and tool.get("name") == name:
            schema = tool.get("input_schema")
            return dict(schema) if isinstance(schema, dict) else None
    return None


def _invalid_value(schema: dict[str, Any]) -> Any:
    required = schema.get("required") or []
    # Drop every required field and add a stray one: invalid for any schema that
    # requires something.
    return {"unexpected": True} if required else {"unexpected": "not in the schema", "__x": 1}


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return target if isinstance(target, dict) else {}
    return node


def _value_for(node: dict[str, Any], prompt: str, root: dict[str, Any], name: str = "") -> Any:
    """A deterministic value matching ``node`` (the JSON schema subset pydantic emits)."""
    node = _resolve(node, root)
    if "default" in node:
        return node["default"]
    if "const" in node:
        return node["const"]
    if isinstance(node.get("enum"), list) and node["enum"]:
        return node["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = node.get(key)
        if isinstance(options, list) and options:
            non_null = [o for o in options if isinstance(o, dict) and o.get("type") != "null"]
            return _value_for((non_null or options)[0], prompt, root, name)
    kind = node.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in node:
        props = node.get("properties") or {}
        return {k: _value_for(v, prompt, root, k) for k, v in props.items() if isinstance(v, dict)}
    if kind == "array":
        items = node.get("items")
        count = max(1, int(node.get("minItems", 1)))
        return (
            [_value_for(items, prompt, root, name) for _ in range(count)]
            if isinstance(items, dict)
            else []
        )
    if kind == "integer":
        return max(int(node.get("minimum", 0)), len(prompt) % 97)
    if kind == "number":
        return float(node.get("minimum", 0.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    words = " ".join(prompt.split()[:8]) or "emulated"
    text = f"{name}: {words}" if name else words
    max_len = node.get("maxLength")
    return text[: int(max_len)] if isinstance(max_len, int) else text

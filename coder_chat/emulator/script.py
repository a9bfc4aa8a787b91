"""The scripted model: deterministic turns described as data.

A :class:`Script` is a list of :class:`ScriptStep`; each step is one LLM call that ends in one
committed assistant message. A step streams its parts (reasoning, text, server-side tool
calls, client tool calls) as deltas, may fail a few retryable attempts first, may fail
fatally, and may sleep before streaming or before committing.

If the last step left client tool calls, a follow-up step is synthesised that mentions the
results (``Results: name → <json>``), so a tool-calling script needs only one step.

Scripts round-trip through JSON (:meth:`Script.from_json` / :meth:`Script.to_json`) so the
control API and the in-text directive (``#emu {...}``, see :func:`parse_directive`) drive the
same machinery.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Failure",
    "Reasoning",
    "Script",
    "ScriptStep",
    "ScriptedToolCall",
    "ServerToolCall",
    "Sleep",
    "Text",
    "parse_directive",
]


@dataclass(frozen=True)
class Text:
    """Assistant text streamed in ``deltas`` chunks, ``delay`` seconds apart."""

    text: str
    deltas: int | None = None
    delay: float | None = None


@dataclass(frozen=True)
class Reasoning:
    """A reasoning part streamed like :class:`Text`."""

    text: str
    deltas: int | None = None
    delay: float | None = None


@dataclass(frozen=True)
class ServerToolCall:
    """A provider-executed (built-in) tool call and its result, committed in the same step."""

    name: str
    args: Any = field(default_factory=dict)
    result: Any = field(default_factory=dict)
    id: str | None = None
    is_error: bool = False


@dataclass(frozen=True)
class ScriptedToolCall:
    """A dynamic (client) tool call: the chat pauses in ``requires_action`` after the step.

    ``name`` must be one of the chat's ``unsafe_dynamic_tools``; otherwise the call is
    treated as an unknown built-in and fails with an error result (no pause).
    """

    name: str
    args: Any = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class Sleep:
    """Pause mid-stream (a long-running turn); interruptible."""

    seconds: float


Part = Text | Reasoning | ServerToolCall | ScriptedToolCall | Sleep


@dataclass(frozen=True)
class Failure:
    """One failed generation attempt (before the step's successful attempt).

    Retryable failures emit a ``retry`` event and the step is retried; a non-retryable
    one ends the turn in ``error``.
    """

    message: str = "The model provider is overloaded."
    kind: str = "overloaded"
    retryable: bool = True
    status_code: int | None = 529
    provider: str | None = "anthropic"
    delay_ms: int = 10
    after_parts: int = 1  # how many of the step's delta parts stream before failing


@dataclass(frozen=True)
class ScriptStep:
    """One LLM call → one assistant message (+ tool result rows)."""

    parts: tuple[Part, ...] = ()
    failures: tuple[Failure, ...] = ()
    commit_delay: float = 0.0
    usage: Mapping[str, int] | None = None

    def client_calls(self) -> list[ScriptedToolCall]:
        """The step's client tool calls."""
        return [p for p in self.parts if isinstance(p, ScriptedToolCall)]


@dataclass(frozen=True)
class Script:
    """A deterministic model turn. Build with the class helpers or from JSON."""

    steps: tuple[ScriptStep, ...]

    # ----------------------------------------------------------------- builders
    @classmethod
    def text(cls, text: str, *, deltas: int | None = None, delay: float | None = None) -> Script:
        """Reply ``text`` in ``deltas`` chunks."""
        return cls((ScriptStep((Text(text, deltas, delay),)),))

    @classmethod
    def of(cls, *steps: ScriptStep | Part | Sequence[Part]) -> Script:
        """Multi-step script: each argument is a ScriptStep, one part, or a list of parts."""
        out: list[ScriptStep] = []
        for s in steps:
            if isinstance(s, ScriptStep):
                out.append(s)
            elif isinstance(s, Part):
                out.append(ScriptStep((s,)))
            else:
                out.append(ScriptStep(tuple(s)))
        return cls(tuple(out))

    @classmethod
    def client_tool(
        cls,
        name: str,
        args: Any = None,
        *,
        id: str | None = None,
        text: str | None = None,
        then: ScriptStep | Sequence[ScriptStep] | None = None,
    ) -> Script:
        """Call one client tool (pause in requires_action); optional follow-up step(s)."""
        parts: list[Part] = []
        if text:
            parts.append(Text(text))
        parts.append(ScriptedToolCall(name, {} if args is None else args, id))
        steps = [ScriptStep(tuple(parts))]
        if isinstance(then, ScriptStep):
            steps.append(then)
        elif then:
            steps.extend(then)
        return cls(tuple(steps))

    @classmethod
    def client_tools(cls, calls: Sequence[tuple[str, Any]]) -> Script:
        """Several client tool calls in one step (all must be answered in one request)."""
        return cls((ScriptStep(tuple(ScriptedToolCall(n, a) for n, a in calls)),))

    @classmethod
    def structured_output(cls, args: Any, *, name: str = "structured_output") -> Script:
        """The model answers by calling the ``structured_output`` client tool with ``args``;
        after the result it says ``Done.``."""
        return cls((ScriptStep((ScriptedToolCall(name, args),)), ScriptStep((Text("Done."),))))

    @classmethod
    def server_tool(
        cls, name: str, args: Any, result: Any, *, text: str = "Tool finished."
    ) -> Script:
        """A provider-executed tool call + result, then a text step."""
        return cls((ScriptStep((ServerToolCall(name, args, result),)), ScriptStep((Text(text),))))

    @classmethod
    def retry_then_success(
        cls, failures: int = 2, text: str = "Recovered.", *, delay_ms: int = 10
    ) -> Script:
        """``failures`` retryable attempts (``retry`` events) then a successful reply."""
        fails = tuple(Failure(delay_ms=delay_ms) for _ in range(failures))
        return cls((ScriptStep((Text(text),), failures=fails),))

    @classmethod
    def fatal(
        cls,
        message: str = "The model provider rejected the request.",
        *,
        kind: str = "config",
        status_code: int | None = 400,
    ) -> Script:
        """A non-retryable failure: the chat ends in ``error`` with an ``error`` event."""
        f = Failure(message=message, kind=kind, retryable=False, status_code=status_code)
        return cls((ScriptStep((Text("partial"),), failures=(f,)),))

    @classmethod
    def long_running(cls, seconds: float, text: str = "Finally done.", chunks: int = 10) -> Script:
        """A turn that streams ``chunks`` deltas spread over ``seconds`` (interruptible)."""
        return cls((ScriptStep((Text(text, deltas=chunks, delay=seconds / max(chunks, 1)),)),))

    @classmethod
    def slow_commit(cls, seconds: float, text: str = "Committed slowly.") -> Script:
        """Stream normally, then wait ``seconds`` before committing the message."""
        return cls((ScriptStep((Text(text),), commit_delay=seconds),))

    # --------------------------------------------------------------------- JSON
    @classmethod
    def from_json(cls, data: Any) -> Script:
        """Parse the JSON script format (see docs/emulator.md)."""
        if isinstance(data, str):
            data = json.loads(data)
        if isinstance(data, list):
            data = {"steps": data}
        if not isinstance(data, Mapping):
            raise ValueError("script must be an object or a list of steps")
        if "steps" not in data:
            data = {"steps": [data]}
        steps = data["steps"]
        if not isinstance(steps, list) or not steps:
            raise ValueError("script.steps must be a non-empty list")
        return cls(tuple(_step_from_json(s) for s in steps))

    def to_json(self) -> dict[str, Any]:
        """Serialise to the JSON script format."""
        return {"steps": [_step_to_json(s) for s in self.steps]}


def _part_from_json(p: Mapping[str, Any]) -> Part:
    t = p.get("type")
    if t == "text":
        return Text(str(p["text"]), p.get("deltas"), p.get("delay"))
    if t == "reasoning":
        return Reasoning(str(p["text"]), p.get("deltas"), p.get("delay"))
    if t == "server_tool":
        return ServerToolCall(
            str(p["name"]),
            p.get("args", {}),
            p.get("result", {}),
            p.get("id"),
            bool(p.get("is_error", False)),
        )
    if t == "client_tool":
        return ScriptedToolCall(str(p["name"]), p.get("args", {}), p.get("id"))
    if t == "sleep":
        return Sleep(float(p["seconds"]))
    raise ValueError(f"unknown script part type {t!r}")


def _failure_from_json(f: Mapping[str, Any]) -> Failure:
    base = Failure()
    return Failure(
        message=str(f.get("message", base.message)),
        kind=str(f.get("kind", base.kind)),
        retryable=bool(f.get("retryable", True)),
        status_code=f.get("status_code", base.status_code),
        provider=f.get("provider", base.provider),
        delay_ms=int(f.get("delay_ms", base.delay_ms)),
        after_parts=int(f.get("after_parts", base.after_parts)),
    )


def _step_from_json(s: Any) -> ScriptStep:
    if not isinstance(s, Mapping):
        raise ValueError("each step must be an object")
    parts: list[Part] = []
    if "parts" in s:
        parts = [_part_from_json(p) for p in s["parts"]]
    else:
        # Shorthand keys, assembled in a fixed order.
        deltas, delay = s.get("deltas"), s.get("delay")
        if "sleep" in s:
            parts.append(Sleep(float(s["sleep"])))
        if "reasoning" in s:
            parts.append(Reasoning(str(s["reasoning"]), deltas, delay))
        for t in s.get("server_tools", []):
            parts.append(_part_from_json({"type": "server_tool", **t}))
        if "text" in s:
            parts.append(Text(str(s["text"]), deltas, delay))
        for t in s.get("tool_calls", []):
            parts.append(_part_from_json({"type": "client_tool", **t}))
        if "structured_output" in s:
            parts.append(ScriptedToolCall("structured_output", s["structured_output"]))
    failures = [_failure_from_json(f) for f in s.get("failures", [])]
    if "retries" in s:
        failures += [Failure() for _ in range(int(s["retries"]))]
    if "fatal" in s:
        fat = s["fatal"] if isinstance(s["fatal"], Mapping) else {"message": str(s["fatal"])}
        failures.append(
            _failure_from_json({"kind": "config", "status_code": 400, **fat, "retryable": False})
        )
    return ScriptStep(
        tuple(parts),
        tuple(failures),
        float(s.get("commit_delay", 0.0)),
        s.get("usage"),
    )


def _part_to_json(p: Part) -> dict[str, Any]:
    if isinstance(p, Text):
        return {"type": "text", "text": p.text, "deltas": p.deltas, "delay": p.delay}
    if isinstance(p, Reasoning):
        return {"type": "reasoning", "text": p.text, "deltas": p.deltas, "delay": p.delay}
    if isinstance(p, ServerToolCall):
        return {
            "type": "server_tool",
            "name": p.name,
            "args": p.args,
            "result": p.result,
            "id": p.id,
            "is_error": p.is_error,
        }
    if isinstance(p, ScriptedToolCall):
        return {"type": "client_tool", "name": p.name, "args": p.args, "id": p.id}
    return {"type": "sleep", "seconds": p.seconds}


def _step_to_json(s: ScriptStep) -> dict[str, Any]:
    return {
        "parts": [_part_to_json(p) for p in s.parts],
        "failures": [f.__dict__ for f in s.failures],
        "commit_delay": s.commit_delay,
        "usage": dict(s.usage) if s.usage else None,
    }


_DIRECTIVE = re.compile(r"#emu\s+(?P<json>[\[{].*)\Z", re.DOTALL)


def parse_directive(text: str) -> tuple[Script | None, str | None]:
    """Find an ``#emu <json>`` directive in user text.

    The directive starts at ``#emu`` and the JSON runs to the end of the text. Returns
    ``(script, None)``, ``(None, None)`` when there is no directive, or
    ``(None, error)`` when the JSON is malformed (the turn then fails fatally with that
    message, so a typo is visible rather than silently echoed).
    """
    idx = text.find("#emu")
    if idx < 0:
        return None, None
    m = _DIRECTIVE.search(text, idx)
    if not m:
        return None, "malformed #emu directive: expected JSON after '#emu '"
    try:
        return Script.from_json(json.loads(m.group("json"))), None
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"malformed #emu directive: {exc}"

"""History rehydration and recovery reads (pure parts; paging is covered in
test_history_emulator.py against the real emulator)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from coder_chat.history import (
    DynamicToolPart,
    FilePart,
    ReasoningPart,
    SourceUrlPart,
    TextPart,
    count_marker_attempts,
    final_text,
    recover_turn_result,
    rehydrate,
)
from coder_chat.models import ChatMessage


def m(mid: int, role: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"id": mid, "role": role, "content": list(parts)}


def t(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def call(cid: str, name: str, args: Any = None, **kw: Any) -> dict[str, Any]:
    p = {"type": "tool-call", "tool_call_id": cid, "tool_name": name, **kw}
    if args is not None:
        p["args"] = args
    return p


def result(cid: str, res: Any, is_error: bool = False, **kw: Any) -> dict[str, Any]:
    return {"type": "tool-result", "tool_call_id": cid, "result": res, "is_error": is_error, **kw}


HISTORY = [
    m(5, "tool", result("c2", "nope", True)),
    m(1, "user", t("[wf/1] hi")),
    m(
        2,
        "assistant",
        {"type": "reasoning", "text": "hmm"},
        t("Let me look. "),
        call("s1", "execute", {"cmd": "ls"}, provider_executed=True),
        result("s1", {"out": "a"}, provider_executed=True),
        t("Found it. "),
        call("c1", "add", {"a": 1}),
        call("c2", "add", {"a": 2}),
        call("c3", "add", {"a": 3}),
        call("", "add", {}),
        {"type": "source", "url": "https://s", "title": "S"},
        {"type": "source"},
        {"type": "file", "file_id": "f1", "media_type": "image/png", "name": "x.png"},
        {"type": "file", "file_id": "f2"},
        {"type": "context-file"},
    ),
    m(4, "tool", result("c1", {"sum": 1})),
    m(6, "tool", result("c1", "second result ignored")),
    m(7, "assistant", t("Done: "), t("2"), call("s2", "web", {}), t(" (checked)")),
]


def test_rehydrate_sorts_folds_and_drops_tool_messages() -> None:
    tr = rehydrate(
        HISTORY,
        file_url=lambda p: f"/files/{p['file_id']}" if p.get("media_type") else None,
    )
    assert [x.id for x in tr] == ["1", "2", "7"]
    parts = tr[1].parts
    assert parts[0] == ReasoningPart("hmm")
    assert parts[1] == TextPart("Let me look. ")
    s1 = parts[2]
    assert isinstance(s1, DynamicToolPart)
    assert (s1.state, s1.output, s1.provider_executed) == ("output-available", {"out": "a"}, True)
    c1, c2, c3 = parts[4], parts[5], parts[6]
    assert isinstance(c1, DynamicToolPart) and c1.output == {"sum": 1}
    assert (
        isinstance(c2, DynamicToolPart) and c2.state == "output-error" and c2.error_text == "nope"
    )
    assert (
        isinstance(c3, DynamicToolPart) and c3.state == "input-available" and c3.input == {"a": 3}
    )
    assert c3.provider_executed is None
    assert parts[7] == SourceUrlPart("https://s", "https://s", "S")
    assert parts[8] == FilePart("/files/f1", "image/png", "x.png")
    assert len(parts) == 9
    assert tr[0].text == "[wf/1] hi"


def test_error_text_shapes() -> None:
    tr = rehydrate(
        [
            m(1, "assistant", call("a", "x"), call("b", "x"), call("c", "x")),
            m(2, "tool", result("a", {"e": 1}, True), result("b", None, True)),
        ]
    )
    a, b, c = tr[0].parts
    assert isinstance(a, DynamicToolPart) and a.error_text == '{"e": 1}'
    assert isinstance(b, DynamicToolPart) and b.error_text == ""
    assert isinstance(c, DynamicToolPart) and c.state == "input-available"


def test_rehydrate_accepts_models() -> None:
    models = [ChatMessage.model_validate(x) for x in HISTORY]
    assert [x.id for x in rehydrate(models)] == ["1", "2", "7"]
    assert rehydrate(models)[1].parts[2] == rehydrate(HISTORY)[1].parts[2]


def test_final_text_cuts_at_last_client_tool() -> None:
    rec = recover_turn_result(HISTORY, client_tool_names={"add"}, marker="[wf/1]")
    assert rec is not None
    assert rec.user_message_id == 1 and rec.submitted
    # the server-side "web" call does not cut; narration around it survives
    assert rec.text == "Done: 2 (checked)"
    assert final_text(rec.parts, set()) == "Let me look. Found it. Done: 2 (checked)"
    other = recover_turn_result(HISTORY, client_tool_names={"add"}, marker="[wf/2]")
    assert other is not None and other.submitted is False
    assert recover_turn_result([m(3, "assistant", t("x"))], client_tool_names=set()) is None


class Answer(BaseModel):
    n: int


def test_recover_structured_last_validating() -> None:
    hist = [
        m(1, "user", t("q")),
        m(2, "assistant", call("a", "structured_output", {"n": 1})),
        m(3, "tool", result("a", "ok")),
        m(
            4,
            "assistant",
            call("b", "structured_output", {"n": 2}),
            call("c", "structured_output", {"n": "x"}),
        ),
        m(5, "tool", result("b", "ok"), result("c", "bad", True)),
        m(6, "assistant", t("filed")),
    ]
    rec = recover_turn_result(hist, client_tool_names={"structured_output"}, output_model=Answer)
    assert rec is not None and rec.structured == Answer(n=2) and rec.text == "filed"


def test_recover_turn_by_user_message_id() -> None:
    hist = [
        m(1, "user", t("a")),
        m(2, "assistant", t("A")),
        m(3, "user", t("b")),
        m(4, "assistant", t("B")),
    ]
    assert recover_turn_result(hist, client_tool_names=set(), user_message_id=1).text == "A"  # type: ignore[union-attr]
    assert recover_turn_result(hist, client_tool_names=set()).text == "B"  # type: ignore[union-attr]


def test_count_marker_attempts_contiguous_tail() -> None:
    hist = [
        m(1, "user", t("[s1] x")),
        m(2, "user", t("other")),
        m(3, "user", t("[s1] again")),
        m(4, "assistant", t("[s1] in assistant text does not count")),
        m(5, "user", t("[s1] third")),
    ]
    assert count_marker_attempts(reversed(hist), "[s1]") == (2, True)
    assert count_marker_attempts(hist[2:], "[s1]") == (2, False)
    assert count_marker_attempts(hist, "[s2]") == (0, True)
    assert count_marker_attempts([], "[s1]") == (0, False)

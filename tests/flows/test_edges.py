"""Pure parts of the Prefect layer: parameter validation, registry, keys,
observability mapping, artifact rendering, retry classification."""

from __future__ import annotations

import logging

import pytest
from pydantic import BaseModel

from coder_chat.errors import CoderApiError, CoderChatError, CoderStreamError
from coder_chat.events import HttpRequest, SegmentSettle, WsRedial
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import (
    Step,
    step_marker,
    validate_base_url,
    validate_steps,
    validate_workflow_id,
)
from prefect_coder.flows.common.results import (
    ToolCallRecord,
    TurnResult,
    result_key,
    turn_cache_key,
)
from prefect_coder.flows.common.retry import is_retryable_failure
from prefect_coder.flows.observe.artifacts import artifact_key, render_turn_markdown
from prefect_coder.flows.observe.observer import chat_resource, describe

TOOLS = {"lookup_build"}
MODELS = {"fix_plan"}


def _check(steps: list[Step]) -> None:
    validate_steps(steps, tool_names=TOOLS, output_model_names=MODELS)


def test_valid_steps_pass() -> None:
    _check(
        [
            Step(name="a", prompt="x", tools=["lookup_build"]),
            Step(name="b", prompt="y", output_model="fix_plan"),
        ]
    )


@pytest.mark.parametrize(
    ("steps", "field", "fix_word"),
    [
        ([], "steps", "at least one step"),
        ([Step(name="a", prompt="x", tools=["nope"])], "steps[0].tools[0]", "register"),
        ([Step(name="a", prompt="x"), Step(name="a", prompt="y")], "steps[1].name", "unique"),
        ([Step(name="a/b", prompt="x")], "steps[0].name", "letters"),
        ([Step(name="a", prompt="  ")], "steps[0].prompt", "write"),
        ([Step(name="a", prompt="x", output_model="Nope")], "steps[0].output_model", "register"),
    ],
)
def test_bad_steps_name_field_and_fix(steps: list[Step], field: str, fix_word: str) -> None:
    with pytest.raises(WorkflowParameterError) as info:
        _check(steps)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert fix_word in info.value.fix


def test_unknown_tool_lists_registered_names() -> None:
    with pytest.raises(WorkflowParameterError, match="registered: lookup_build"):
        _check([Step(name="a", prompt="x", tools=["lookup"])])


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x]", "-lead", "a" * 129])
def test_bad_workflow_ids(bad: str) -> None:
    with pytest.raises(WorkflowParameterError, match=r"^workflow_id: "):
        validate_workflow_id(bad)


@pytest.mark.parametrize(
    "url", ["not a url", "ftp://h", "localhost:3000", "http://user:pw@h", "https://h/?token=x"]
)
def test_bad_base_urls(url: str) -> None:
    with pytest.raises(WorkflowParameterError, match=r"^blk\.base_url: "):
        validate_base_url(url, "blk.base_url")


def test_good_base_url() -> None:
    validate_base_url("http://127.0.0.1:4000", "x")
    validate_base_url("https://coder.example.com/", "x")


def test_marker_and_result_key_are_stable_and_safe() -> None:
    assert step_marker("wf-1", "plan") == "[wf-1/plan]"
    key = result_key("wf:1@x", "plan")
    assert key == result_key("wf:1@x", "plan")
    assert "/" not in key and ":" not in key and "@" not in key
    # the replaced characters must not make distinct ids collide
    assert result_key("wf:1", "a") != result_key("wf@1", "a")
    assert turn_cache_key(None, {"workflow_id": "wf:1@x", "step": Step(name="plan", prompt="p")})
    assert turn_cache_key(None, {"workflow_id": "w", "step": {"name": "s"}}) == result_key("w", "s")


def test_registry_rejects_a_different_tool_under_a_taken_name() -> None:
    import prefect_coder.flows.demo_tools  # noqa: F401  (registers)

    assert {"lookup_build", "record_note"} <= registry.tool_names()
    assert "fix_plan" in registry.output_model_names()
    with pytest.raises(ValueError, match="already registered"):

        @registry.registered_tool(name="lookup_build", description="impostor")
        async def impostor(args: BaseModel) -> None: ...

    # the same object registers twice without complaint (modules imported twice)
    registry.register_tool(registry.get_tool("lookup_build"))


def test_missing_tool_module_is_a_parameter_error() -> None:
    with pytest.raises(WorkflowParameterError, match=r"^settings.tool_modules\[1\]: "):
        registry.load_tool_modules(["prefect_coder.flows.demo_tools", "no_such_module_xyz"])


def test_describe_redial_and_settles() -> None:
    redial = describe(
        WsRedial(
            chat_id="c1",
            reader=3,
            attempt=2,
            consecutive_failures=2,
            max_consecutive_failures=5,
            backoff_ms=400,
        )
    )
    assert redial is not None and redial.level == logging.WARNING
    assert redial.event == "coder.stream.redial" and "2/5" in redial.message
    clean = describe(
        SegmentSettle(
            segment=1,
            chat_id="c1",
            duration_ms=12.5,
            ending="clean",
            status="waiting",
            finish_reason="stop",
        )
    )
    assert clean is not None and clean.event is None  # log line only
    assert "status=waiting" in clean.message and clean.payload["duration_ms"] == 12.5
    failed = describe(
        SegmentSettle(
            segment=2,
            duration_ms=5,
            ending="failure",
            error={"name": "CoderChatError", "message": "boom"},
        )
    )
    assert failed is not None and failed.level == logging.WARNING
    assert failed.event == "coder.segment.failed" and "boom" in failed.message
    assert describe(HttpRequest(id=1, op="getChat", method="GET", path="/x")) is None


def test_chat_resource() -> None:
    assert chat_resource("c1", "wf")["prefect.resource.id"] == "coder.chat.c1"
    assert chat_resource(None, "wf")["prefect.resource.id"] == "coder.workflow.wf"


def test_artifact_markdown_and_key() -> None:
    result = TurnResult(
        workflow_id="wf-1",
        step="plan",
        marker="[wf-1/plan]",
        chat_id="c1",
        text="answer with ``` fence",
        finish_reason="stop",
        usage={"input_tokens": 3, "output_tokens": 4},
        tool_calls=[
            ToolCallRecord(id="t1", name="lookup_build", kind="client", args={"build_id": "n"}),
            ToolCallRecord(name="web|search", kind="server", output="x" * 500),
        ],
        structured={"summary": "s"},
    )
    md = render_turn_markdown(result, "[wf-1/plan] do it")
    assert "````text\nanswer with ``` fence\n````" in md
    assert "| `lookup_build` | client |" in md and "web\\|search" in md
    assert "| input_tokens | 3 |" in md and '"summary": "s"' in md
    key = artifact_key("WF:1", "Plan_A")
    assert key.startswith("coder-turn-wf-1-plan-a-") and key == key.lower()


def test_retry_classification() -> None:
    assert is_retryable_failure(CoderChatError("t", kind="timeout", retryable=True))
    assert not is_retryable_failure(CoderChatError("x", kind="generic"))
    assert is_retryable_failure(CoderStreamError("s", url="ws://x", is_retryable=True))
    assert not is_retryable_failure(CoderStreamError("s", url="ws://x"))
    for status in (408, 425, 429, 500, 503):
        assert is_retryable_failure(CoderApiError(status, "POST", "/p", "m"))
    for status in (400, 401, 403, 404, 409):
        assert not is_retryable_failure(CoderApiError(status, "POST", "/p", "m"))
    assert not is_retryable_failure(TimeoutError())
    assert not is_retryable_failure(ValueError())

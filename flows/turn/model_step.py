"""Model-only steps: one call to the deployment's AI Gateway, no chat, no workspace.

Plan / extract / summarize / classify steps need a model, not Coder's server-side
agent. :func:`model_step` sends the step's prompt to the AI Gateway's
OpenAI-compatible (``api="openai"``) or Anthropic-compatible surface, over the
flow run's shared ``httpx`` pool, authenticated with the Coder token (or BYOK,
see ``CoderCredentials.ai_gateway_upstream_key``). With ``output_model`` the
answer is validated JSON of that registered pydantic model (one re-ask on
invalid output, then :class:`~coder_chat.gateway.GatewayOutputError`).

The result is persisted like a turn's, under a key derived from (workflow id,
step name) only, so a re-run of the workflow returns it without calling the
model again. 429 and 5xx are retried by Prefect (``settings.retries``); 401/403
and invalid output are not.

``{previous}`` in the prompt is replaced by the previous step's answer (its
structured JSON if it had one, else its text).
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import task
from prefect.logging import get_run_logger
from prefect.states import State
from pydantic import BaseModel, Field

from coder_chat.gateway import GatewayClient, GatewayError
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.params import ModelStep, WorkflowSettings
from prefect_coder.flows.common.resources import TurnResources, load_resources
from prefect_coder.flows.common.result_write import ResultNotPersistedError, write_step_result
from prefect_coder.flows.common.results import result_key

__all__ = ["ModelStepResult", "model_result_key", "model_step", "render_prompt"]


class ModelStepResult(BaseModel):
    """What a model-only step returns (and what a re-run returns from storage)."""

    kind: Literal["model"] = "model"
    workflow_id: str
    step: str
    api: str
    model: str | None = None
    text: str
    structured: dict[str, Any] | None = None
    attempts: int = Field(default=1, description="Model calls made (2 after a re-ask).")
    usage: dict[str, Any] = Field(default_factory=dict)
    duration_ms: float = 0.0


def model_result_key(workflow_id: str, step_name: str) -> str:
    """Storage key of a model step's result (stable across runs, lock-safe)."""
    return result_key(workflow_id, step_name, kind="model")


def _cache_key(_context: object, parameters: dict[str, Any]) -> str:
    step = parameters["step"]
    name = step["name"] if isinstance(step, dict) else step.name
    return model_result_key(str(parameters["workflow_id"]), str(name))


async def _retry_transient(_task: Any, _task_run: Any, state: State[Any]) -> bool:
    # Async: a sync condition cannot read an async task's result.
    try:
        exc = await state.aresult(raise_on_failure=False)
    except Exception:
        return False
    # A result the storage refused is retried too: the model is asked again (a model
    # step has no history to recover its answer from), never a silent Completed.
    return (isinstance(exc, GatewayError) and exc.retryable) or isinstance(
        exc, ResultNotPersistedError
    )


def render_prompt(prompt: str, previous: str | None) -> str:
    """Substitute ``{previous}`` (the previous step's answer; empty if none)."""
    return prompt.replace("{previous}", previous or "")


def gateway_for(resources: TurnResources) -> GatewayClient:
    """A gateway client on the flow run's shared pool (or a new one)."""
    creds = resources.credentials
    options: dict[str, Any] = {
        "upstream_key": creds.ai_gateway_upstream_key,
        "openai_provider": creds.ai_gateway_openai_provider,
        "anthropic_provider": creds.ai_gateway_anthropic_provider,
        "timeout": creds.request_timeout,
    }
    if resources.client is not None:
        return GatewayClient.from_chat_client(resources.client, creds.token, **options)
    return GatewayClient(creds.base_url, creds.token, **options)


async def execute_model_step(
    workflow_id: str,
    step: ModelStep,
    settings: WorkflowSettings,
    resources: TurnResources,
    previous: str | None = None,
) -> ModelStepResult:
    """The body of :func:`model_step` (callable without Prefect's task machinery)."""
    api = step.api or "openai"
    if not step.model:
        raise ValueError(f"step {step.name!r}: a model step needs `model` (the gateway's name)")
    prompt = render_prompt(step.prompt, previous)
    timeout = settings.request_timeout_s or resources.credentials.request_timeout
    async with gateway_for(resources) as gateway:
        if step.output_model:
            output = registry.get_output_model(step.output_model)
            reply = await gateway.structured(
                api, step.model, prompt, output, system=step.system, timeout=timeout
            )
            return ModelStepResult(
                workflow_id=workflow_id,
                step=step.name,
                api=api,
                model=reply.model,
                text=reply.raw,
                structured=reply.value.model_dump(mode="json"),
                attempts=reply.attempts,
                usage=reply.usage,
                duration_ms=reply.duration_ms,
            )
        plain = await gateway.complete(
            api,
            step.model,
            [{"role": "user", "content": prompt}],
            system=step.system,
            timeout=timeout,
        )
        return ModelStepResult(
            workflow_id=workflow_id,
            step=step.name,
            api=api,
            model=plain.model,
            text=plain.text,
            usage=plain.usage,
            duration_ms=plain.duration_ms,
        )


@task(
    name="model-step",
    task_run_name="{workflow_id}/{step.name}",
    cache_key_fn=_cache_key,
    persist_result=True,
    result_serializer="json",
    retry_condition_fn=_retry_transient,
    retries=2,
    retry_delay_seconds=5,
)
async def model_step(
    workflow_id: str,
    step: ModelStep,
    settings: WorkflowSettings,
    resources: TurnResources | None = None,
    previous: str | None = None,
) -> ModelStepResult:
    """One model-only step through the AI Gateway. Re-running a finished (workflow,
    step) returns its stored result without calling the model."""
    if resources is None:
        resources = await load_resources(settings)
    result = await execute_model_step(workflow_id, step, settings, resources, previous)
    get_run_logger().info(
        "model step %s answered via %s in %.0f ms (%d call(s))",
        step.name,
        result.api,
        result.duration_ms,
        result.attempts,
    )
    # Written here, loudly (flows/common/result_write.py): Prefect's commit would log a
    # refused write and leave the task Completed with nothing stored.
    return await write_step_result(result, workflow_id=workflow_id, step=step.name)

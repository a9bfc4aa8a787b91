"""Named client tools and structured-output models, so deployment parameters can
refer to them by name.

A deployment parameter is JSON: it cannot carry a Python function. Tools and
output models therefore register under a name in the worker's process (import
time of a module listed in ``WorkflowSettings.tool_modules``), and each step
names what it needs. Unknown names fail in :func:`prefect_coder.flows.parts.params.validate_steps`
before any chat exists.

Usage::

    from pydantic import BaseModel
    from prefect_coder.flows.parts.registry import output_model, registered_tool

    class Args(BaseModel):
        build_id: str

    @registered_tool(name="lookup_build", description="Fetch a CI build's status.")
    async def lookup_build(args: Args, ctx) -> dict:
        ...

    @output_model("fix_plan")
    class FixPlan(BaseModel):
        summary: str
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from prefect_coder.flows.parts.errors import WorkflowParameterError
from pydantic import BaseModel

if TYPE_CHECKING:
    from coder_chat.tools import ClientTool

__all__ = [
    "get_output_model",
    "get_tool",
    "load_tool_modules",
    "output_model",
    "output_model_names",
    "register_output_model",
    "register_tool",
    "registered_tool",
    "tool_names",
]

M = TypeVar("M", bound=type[BaseModel])

_lock = threading.Lock()
_tools: dict[str, ClientTool] = {}
_models: dict[str, type[BaseModel]] = {}


def register_tool(tool: ClientTool, *, replace: bool = False) -> ClientTool:
    """Register a :class:`coder_chat.tools.ClientTool` under its ``name``.

    Re-registering the same object is a no-op (modules may be imported twice);
    a different tool under a taken name raises unless ``replace``.
    """
    with _lock:
        current = _tools.get(tool.name)
        if current is not None and current is not tool and not replace:
            raise ValueError(f"a different client tool is already registered as {tool.name!r}")
        _tools[tool.name] = tool
    return tool


def registered_tool(
    *, name: str, description: str
) -> Callable[[Callable[..., Awaitable[Any]]], ClientTool]:
    """Decorator: build a client tool with ``coder_chat.tools.client_tool`` and register it."""
    from coder_chat.tools import client_tool

    def wrap(fn: Callable[..., Awaitable[Any]]) -> ClientTool:
        return register_tool(client_tool(name=name, description=description)(fn))

    return wrap


def register_output_model(model: M, *, name: str | None = None, replace: bool = False) -> M:
    """Register a pydantic model as a structured-output schema under ``name``."""
    key = name or model.__name__
    with _lock:
        current = _models.get(key)
        if current is not None and current is not model and not replace:
            raise ValueError(f"a different output model is already registered as {key!r}")
        _models[key] = model
    return model


def output_model(name: str | None = None) -> Callable[[M], M]:
    """Decorator form of :func:`register_output_model`."""

    def wrap(model: M) -> M:
        return register_output_model(model, name=name)

    return wrap


def get_tool(name: str) -> ClientTool:
    """The tool registered as ``name`` (KeyError if none)."""
    return _tools[name]


def get_output_model(name: str) -> type[BaseModel]:
    """The output model registered as ``name`` (KeyError if none)."""
    return _models[name]


def tool_names() -> set[str]:
    """Names of all registered client tools."""
    with _lock:
        return set(_tools)


def output_model_names() -> set[str]:
    """Names of all registered output models."""
    with _lock:
        return set(_models)


def load_tool_modules(modules: Sequence[str], *, field: str = "settings.tool_modules") -> None:
    """Import the modules that register tools; a missing module is a parameter error."""
    for i, module in enumerate(modules):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise WorkflowParameterError(
                f"{field}[{i}]",
                f"module {module!r} cannot be imported ({exc})",
                "install the package that defines your tools on the worker, or fix the module path",
            ) from None

"""Named client tools and structured-output models, so deployment parameters can
refer to them by name.

A deployment parameter is JSON: it cannot carry a Python function. Tools and
output models therefore register under a name in the worker's process, at import
time of a tool module, and each step names what it needs. Tool modules come from
one worker-wide setting shared by every deployment — the ``prefect_coder.tools``
entry-point group of installed packages, or ``PREFECT_CODER_TOOL_MODULES`` —
merged with a run's own ``WorkflowSettings.tool_modules``
(:func:`load_tool_modules`). Unknown names fail in
:func:`prefect_coder.flows.common.params.validate_steps` before any chat exists.

Every registered tool runs behind the write-ahead tool ledger in a durable
workflow (crash-safe by default); ``pure=True`` declares one side-effect free.

Usage::

    from pydantic import BaseModel
    from prefect_coder.flows.common.registry import output_model, registered_tool

    class Args(BaseModel):
        build_id: str

    @registered_tool(name="lookup_build", description="Fetch a CI build's status.", pure=True)
    async def lookup_build(args: Args, ctx) -> dict:
        ...

    @output_model("fix_plan")
    class FixPlan(BaseModel):
        summary: str
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from importlib import metadata
from typing import Any, TypeVar

from pydantic import BaseModel

from coder_chat import crash_safe
from coder_chat.tools import ClientTool, client_tool
from prefect_coder.flows.common.errors import WorkflowParameterError

__all__ = [
    "TOOLS_ENTRY_POINT_GROUP",
    "TOOL_MODULES_ENV",
    "env_tool_modules",
    "get_output_model",
    "get_tool",
    "load_form_tool_modules",
    "load_tool_modules",
    "output_model",
    "output_model_names",
    "register_output_model",
    "register_tool",
    "registered_tool",
    "rescan_entry_points",
    "shared_tool_sources",
    "tool_names",
]

#: Worker environment variable: tool modules every flow of this worker imports.
TOOL_MODULES_ENV = "PREFECT_CODER_TOOL_MODULES"
#: Entry-point group: installed packages declare their tool modules here.
TOOLS_ENTRY_POINT_GROUP = "prefect_coder.tools"

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
    *, name: str, description: str, pure: bool = False
) -> Callable[[Callable[..., Awaitable[Any]]], ClientTool]:
    """Decorator: build a client tool with ``coder_chat.tools.client_tool`` and register it.

    In a durable workflow every registered tool runs behind the write-ahead tool
    ledger (crash-safe by default; see :func:`prefect_coder.flows.common.toolset.bind_crash_safe`):
    ``ctx.idempotency_key`` is the ledger key and stays the same when recovery
    re-drives a call whose process died after the effect. Pass ``pure=True`` for a
    side-effect-free tool (a lookup, a computation): it skips the ledger, and
    recovery answers a pause it left behind by running it again.
    """

    def wrap(fn: Callable[..., Awaitable[Any]]) -> ClientTool:
        tool: ClientTool = client_tool(name=name, description=description)(fn)
        return register_tool(crash_safe.pure(tool) if pure else tool)

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


def _split_modules(raw: str) -> list[str]:
    return [m for m in re.split(r"[\s,]+", raw) if m]


def env_tool_modules() -> list[str]:
    """The modules named by ``PREFECT_CODER_TOOL_MODULES`` (comma or space separated)."""
    return _split_modules(os.environ.get(TOOL_MODULES_ENV, ""))


# The scan walks every installed distribution's metadata: it was 7 % of a
# fan-out's CPU when repeated per workflow. Installed packages do not change
# under a running worker process, so one scan per process is enough.
_scanned_entry_points: tuple[metadata.EntryPoint, ...] | None = None
_loaded_entry_points = False


def _entry_points() -> tuple[metadata.EntryPoint, ...]:
    global _scanned_entry_points
    if _scanned_entry_points is None:
        found = metadata.entry_points(group=TOOLS_ENTRY_POINT_GROUP)
        _scanned_entry_points = tuple(sorted(found, key=lambda ep: ep.name))
    return _scanned_entry_points


def rescan_entry_points() -> None:
    """Forget this process's ``prefect_coder.tools`` scan (after installing a
    package into a running process); the next load scans again."""
    global _scanned_entry_points, _loaded_entry_points
    _scanned_entry_points = None
    _loaded_entry_points = False


def shared_tool_sources() -> list[str]:
    """Where this worker's shared tool modules come from, for logs and reports:
    ``PREFECT_CODER_TOOL_MODULES`` entries, then ``entry point <name> = <value>``."""
    return [*env_tool_modules(), *(f"entry point {ep.name} = {ep.value}" for ep in _entry_points())]


def load_tool_modules(modules: Sequence[str], *, field: str = "settings.tool_modules") -> None:
    """Import every module that registers tools; a missing one is a parameter error.

    Three sources, merged, so a user's tools are known to *every* flow — the
    workflow, ``agent-turn``, ``recover-turn`` and the sweeps, which must offer and
    reconcile the same tools — without repeating them in each deployment's
    parameters:

    1. ``modules`` — the run's own ``settings.tool_modules``;
    2. ``PREFECT_CODER_TOOL_MODULES`` on the worker (or the work pool's job
       variables ``env``): comma- or space-separated module names;
    3. the ``prefect_coder.tools`` entry-point group of every installed package
       (``[project.entry-points."prefect_coder.tools"] mytools = "mytools"``):
       installing the package on the worker is the whole setup.

    Importing a module twice is a no-op (Python caches it; registering the same
    tool object again is allowed).
    """
    for i, module in enumerate(modules):
        _import(module, f"{field}[{i}]", "fix the module path or install its package on the worker")
    for module in env_tool_modules():
        _import(
            module,
            TOOL_MODULES_ENV,
            f"fix {TOOL_MODULES_ENV} on the worker / work pool, or install the module's package",
        )
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    for ep in _entry_points():
        where = f"entry point {ep.name!r} of group {TOOLS_ENTRY_POINT_GROUP!r}"
        try:
            ep.load()
        except Exception as exc:
            raise WorkflowParameterError(
                where,
                f"{ep.value!r} cannot be loaded ({type(exc).__name__}: {exc})",
                "fix the package that declares the entry point, or uninstall it from the worker",
            ) from None
    # Only after every entry point loaded: a failed load is reported again next run.
    _loaded_entry_points = True


def load_form_tool_modules(modules: Sequence[str]) -> list[str]:
    """Import ``modules``, ``PREFECT_CODER_TOOL_MODULES`` and the ``prefect_coder.tools``
    entry points for a deployment's form (its tool and output-model choices), as
    ``prefect deploy`` builds it. Never raises: returns what could not be imported
    (a run that needs it fails at its edge, naming the source and the fix).

    Its own entry-point scan, not :func:`load_tool_modules`' per-process one: a
    process that imports the flows (and so builds their forms) before a package is
    installed — a forking launcher's parent — must not hand its children a scan
    without it."""
    failed: list[str] = []
    for module in [*modules, *env_tool_modules()]:
        try:
            importlib.import_module(module)
        except Exception:
            failed.append(module)
    points = metadata.entry_points(group=TOOLS_ENTRY_POINT_GROUP)
    for ep in sorted(points, key=lambda ep: ep.name):
        try:
            ep.load()
        except Exception:
            failed.append(f"entry point {ep.name} = {ep.value}")
    return failed


def _import(module: str, field: str, fix: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise WorkflowParameterError(
            field,
            f"module {module!r} cannot be imported ({exc})",
            f"install the package that defines your tools on the worker, or {fix}",
        ) from None

"""What Prefect sees of the blocks: entry point, block types, schemas, secret fields."""

from __future__ import annotations

import subprocess
import sys
import uuid
from importlib.metadata import entry_points
from pathlib import Path

from prefect.blocks.core import Block
from prefect.utilities.dispatch import get_registry_for_type

import prefect_coder
from prefect_coder.blocks import ChatStateStore, CoderCredentials

REPO = Path(__file__).resolve().parents[2]


def test_collections_entry_point_imports_the_blocks() -> None:
    (ep,) = [e for e in entry_points(group="prefect.collections") if e.name == "prefect_coder"]
    assert ep.value == "prefect_coder"
    module = ep.load()
    assert module is prefect_coder
    found = {n for n in dir(module) if Block.is_block_class(getattr(module, n))}
    assert found == {"ChatStateStore", "CoderCredentials"}
    # Defining the classes registers them in Prefect's dispatch registry, which is what a
    # server started in this environment registers at start-up.
    registry = get_registry_for_type(Block) or {}
    assert registry.get("coder-credentials") is CoderCredentials
    assert registry.get("chat-state-store") is ChatStateStore


def test_schemas_mark_secrets_and_are_json() -> None:
    creds = CoderCredentials._to_block_schema(block_type_id=uuid.uuid4())
    assert creds.fields["secret_fields"] == ["token", "ai_gateway_upstream_key"]
    props = creds.fields["properties"]
    assert props["organization_id"]["format"] == "uuid"
    assert set(creds.fields["required"]) == {"base_url", "organization_id", "token"}
    store = ChatStateStore._to_block_schema(block_type_id=uuid.uuid4())
    assert store.fields["secret_fields"] == ["password"]
    assert "required" not in store.fields or not store.fields["required"]
    # The default URL is resolved on the machine that uses the block, not stored.
    assert store.fields["properties"]["url"].get("default") is None
    assert CoderCredentials.get_block_type_slug() == "coder-credentials"
    assert ChatStateStore.get_block_type_slug() == "chat-state-store"


def test_installed_names_cannot_collide() -> None:
    """From outside the checkout only the namespaced packages exist: a user's own
    ``flows/`` or ``blocks/`` folder neither shadows ours nor is shadowed by it."""
    code = (
        "import importlib.util as u, prefect_coder.flows, prefect_coder.blocks, coder_chat;"
        "print(u.find_spec('flows'), u.find_spec('blocks'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "None None"
    assert Path(prefect_coder.__file__).parent == REPO / "prefect_coder"


def test_emulator_plugin_is_opt_in() -> None:
    """The emulator's pytest plugin is not registered for every pytest session."""
    assert not [e for e in entry_points(group="pytest11") if e.value.startswith("coder_chat")]


def test_every_package_folder_is_installed() -> None:
    """pyproject lists the packages explicitly (flows/ and blocks/ are mapped under
    prefect_coder): a new sub-package missing from the list would be left out of a
    wheel while an editable install still finds it."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    names = {
        "coder_chat": "coder_chat",
        "prefect_coder": "prefect_coder",
        "flows": "prefect_coder.flows",
        "blocks": "prefect_coder.blocks",
    }
    found = {"prefect_coder"}
    for folder, dotted in names.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            if any((REPO / folder).joinpath(*rel[: i + 1]).is_symlink() for i in range(len(rel))):
                continue  # prefect_coder/flows -> ../flows: counted as flows/
            found.add(".".join([dotted, *rel]))
    assert found == listed

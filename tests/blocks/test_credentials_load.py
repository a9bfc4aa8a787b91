"""A CoderCredentials block saved around the block's validation (REST API, an old UI
form) fails at load with the field and the fix, not Prefect's "try validate=False"."""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import BlockDocumentUpdate

from prefect_coder.blocks import CoderCredentials
from prefect_coder.blocks.credentials import InvalidCoderCredentialsError

ORG = "0a1b2c3d-0000-4000-8000-123456789abc"
TOKEN = "tok-LOAD-SECRET-0123456789"


async def _saved_with(data: dict[str, object]) -> str:
    """Save a valid block, then overwrite fields through the API, as a REST user would."""
    name = f"bad-{uuid.uuid4().hex[:8]}"
    block_id = await CoderCredentials(
        base_url="https://coder.example.com", organization_id=ORG, token=TOKEN
    ).save(name)
    async with get_client() as client:
        await client.update_block_document(block_id, BlockDocumentUpdate(data=data))
    return name


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"base_url": "ftp://coder.example.com"}, "base_url: must be an http(s) URL"),
        ({"base_url": "file:///etc/passwd"}, "base_url: must be an http(s) URL"),
        ({"organization_id": "acme"}, "organization_id: must be the organization's UUID"),
        ({"request_timeout": 0}, "request_timeout: Input should be greater than 0"),
    ],
)
async def test_invalid_saved_block_names_field_and_fix(
    prefect_server: Path, data: dict[str, object], needle: str
) -> None:
    name = await _saved_with(data)
    with pytest.raises(InvalidCoderCredentialsError) as info:
        await CoderCredentials.aload(name)
    text = str(info.value)
    assert needle in text
    assert f"CoderCredentials block {name!r} is invalid" in text
    assert f".save({name!r}, overwrite=True)" in text
    assert "validate=False" not in text
    assert TOKEN not in text and "ftp://" not in text and "acme" not in text
    assert info.value.block_name == name and needle in info.value.problems
    restored = pickle.loads(pickle.dumps(info.value))  # crosses process boundaries intact
    assert str(restored) == text
    with pytest.raises(InvalidCoderCredentialsError):
        await CoderCredentials.load(name)  # type: ignore[misc]


async def test_a_workflow_with_an_invalid_block_fails_naming_field_and_fix(
    prefect_server: Path,
) -> None:
    # What a run meets: the workflow's credentials loader, not "no block named ...".
    from prefect_coder.flows.common.params import WorkflowSettings
    from prefect_coder.flows.common.resources import load_credentials

    name = await _saved_with({"base_url": "file:///etc/passwd"})
    with pytest.raises(Exception) as info:
        await load_credentials(WorkflowSettings(credentials_block=name))
    text = str(info.value)
    assert "base_url: must be an http(s) URL" in text and name in text
    assert "no CoderCredentials block named" not in text
    assert "validate=False" not in text and TOKEN not in text


async def test_valid_saved_block_still_loads(prefect_server: Path) -> None:
    name = f"ok-{uuid.uuid4().hex[:8]}"
    await CoderCredentials(
        base_url="https://coder.example.com/", organization_id=ORG, token=TOKEN
    ).save(name)
    loaded = await CoderCredentials.aload(name)
    assert loaded.base_url == "https://coder.example.com"
    assert loaded.token.get_secret_value() == TOKEN

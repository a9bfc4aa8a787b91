"""The fleet-quota and AI Gateway fields of CoderCredentials."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prefect_coder.blocks import CoderCredentials

ORG = "0a1b2c3d-0000-4000-8000-123456789abc"


def _creds(**kw: object) -> CoderCredentials:
    return CoderCredentials(
        base_url="https://coder.example.com", organization_id=ORG, token="tok-SECRET-1", **kw
    )  # type: ignore[arg-type]


def test_defaults_mean_no_cap_and_default_provider_names() -> None:
    c = _creds()
    assert c.max_concurrent_turns is None
    assert (c.turn_slot_wait, c.turn_slot_ttl) == (600.0, 60.0)
    assert (c.ai_gateway_openai_provider, c.ai_gateway_anthropic_provider) == (
        "openai",
        "anthropic",
    )
    assert c.ai_gateway_upstream_key is None


@pytest.mark.parametrize("field", ["max_concurrent_turns", "turn_slot_wait", "turn_slot_ttl"])
def test_bounds(field: str) -> None:
    with pytest.raises(ValidationError):
        _creds(**{field: 0})


def test_upstream_key_is_secret() -> None:
    c = _creds(ai_gateway_upstream_key="sk-UPSTREAM-9", max_concurrent_turns=5)
    for text in (repr(c), str(c), c.model_dump_json()):
        assert "sk-UPSTREAM-9" not in text and "tok-SECRET-1" not in text
    assert c.ai_gateway_upstream_key is not None
    assert c.ai_gateway_upstream_key.get_secret_value() == "sk-UPSTREAM-9"

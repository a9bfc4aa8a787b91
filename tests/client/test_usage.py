"""Usage normalisation and summing (agent-semantics §3.7)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from coder_chat.core.usage import SUMMED_FIELDS, Usage, sum_usages, usage_of_messages


def test_normalised_input_includes_cache() -> None:
    u = Usage.from_raw(
        {"input_tokens": 10, "cache_read_tokens": 5, "cache_creation_tokens": 2, "output_tokens": 3}
    )
    assert u.input_tokens == 17
    assert u.no_cache_input_tokens == 10
    assert u.output_tokens == 3
    assert u.reasoning_tokens is None
    assert not u.is_empty and Usage().is_empty


def test_context_limit_and_unknown_newest_wins() -> None:
    u = usage_of_messages(
        {
            3: {"output_tokens": 1, "context_limit": 300, "model": "b"},
            1: {"output_tokens": 2, "context_limit": 100, "model": "a"},
        }
    )
    assert u.output_tokens == 3 and u.context_limit == 300 and u.raw["model"] == "b"


def test_non_numeric_values_ignored() -> None:
    u = usage_of_messages({1: {"output_tokens": "x", "input_tokens": True, "total_tokens": 2.0}})
    assert u.output_tokens is None and u.no_cache_input_tokens is None and u.total_tokens == 2


counts = st.fixed_dictionaries({k: st.integers(0, 1000) for k in SUMMED_FIELDS})


@given(st.lists(counts, max_size=5), st.lists(counts, max_size=5))
def test_segment_sums_are_associative(a: list[dict[str, int]], b: list[dict[str, int]]) -> None:
    seg_a = usage_of_messages(dict(enumerate(a)))
    seg_b = usage_of_messages({i + 100: v for i, v in enumerate(b)})
    whole = usage_of_messages({**dict(enumerate(a)), **{i + 100: v for i, v in enumerate(b)}})
    assert sum_usages([seg_a, seg_b]) == whole
    for key in SUMMED_FIELDS:
        assert whole.raw.get(key, 0) == sum(x[key] for x in a + b)

"""The collection's chat labels obey chatd's label rules (chatd-wire §6.2)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from prefect_coder.flows.common.labels import (
    COLLECTION,
    LABEL_COLLECTION,
    LABEL_FLOW_RUN,
    LABEL_TENANT,
    LABEL_WORKFLOW,
    chat_labels,
    label_problems,
    label_value,
    owned_by,
    scope_labels,
    workflow_of,
)

KEY_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._/-]*$")


def test_keys_are_valid_chatd_label_keys() -> None:
    for key in (LABEL_COLLECTION, LABEL_TENANT, LABEL_WORKFLOW, LABEL_FLOW_RUN):
        assert KEY_RE.match(key) and len(key.encode()) <= 64


def test_chat_labels_name_collection_tenant_workflow_and_flow_run() -> None:
    labels = chat_labels("acme", "wf-1042", "0b6a3f0e-1c2d-4e5f-8a9b-0c1d2e3f4a5b")
    assert labels == {
        LABEL_COLLECTION: COLLECTION,
        LABEL_TENANT: "acme",
        LABEL_WORKFLOW: "wf-1042",
        LABEL_FLOW_RUN: "0b6a3f0e-1c2d-4e5f-8a9b-0c1d2e3f4a5b",
    }
    assert label_problems(labels) == []
    assert LABEL_FLOW_RUN not in chat_labels("acme", "wf-1")  # outside a flow run
    assert workflow_of(labels) == "wf-1042"


def test_ownership_needs_collection_and_the_same_tenant() -> None:
    labels = chat_labels("acme", "wf-1")
    assert owned_by(labels, "acme")
    assert not owned_by(labels, "other-tenant")
    assert not owned_by({LABEL_WORKFLOW: "wf-1"}, "acme")
    assert not owned_by({}, "acme") and not owned_by(None, "acme")
    assert not owned_by({**labels, LABEL_COLLECTION: "someone-else"}, "acme")


def test_long_values_are_cut_to_256_bytes_and_stay_distinct() -> None:
    a = label_value("é" * 200 + "a")  # 401 bytes
    b = label_value("é" * 200 + "b")
    assert a != b
    for v in (a, b):
        assert len(v.encode()) <= 256
        assert label_problems({LABEL_TENANT: v}) == []
    assert label_value("é" * 200 + "a") == a  # deterministic: the filter matches the write


def test_control_characters_and_blank_values_are_made_valid() -> None:
    assert label_value("a\nb\tc") == "a_b_c"
    assert label_value("   ") == "_"
    assert label_problems(scope_labels("\x00")) == []


@given(st.text(min_size=1, max_size=400))
def test_any_tenant_or_workflow_gives_valid_labels(raw: str) -> None:
    labels = chat_labels(raw, raw, raw)
    assert label_problems(labels) == []
    assert owned_by(labels, raw)


def test_label_problems_reports_each_violation() -> None:
    assert label_problems({"": "x"}) == ["invalid label key ''"]
    assert label_problems({"-bad": "x"}) == ["invalid label key '-bad'"]
    assert label_problems({"k": ""}) == ["invalid value for label 'k'"]
    assert label_problems({"k": "x" * 257}) == ["invalid value for label 'k'"]
    assert label_problems({f"k{i}": "v" for i in range(51)}) == ["too many labels (51 > 50)"]


def test_a_chat_of_another_store_is_told_apart() -> None:
    from prefect_coder.flows.common.labels import LABEL_STORE, chat_labels, of_another_store

    labels = chat_labels("t", "wf", "run-1", "store-a")
    assert labels[LABEL_STORE] == "store-a"
    assert of_another_store(labels, "store-a") is None
    assert of_another_store(labels, "store-b") == "store-a"
    # A chat made before the label existed, or a sweep that does not know its store:
    # no fence (the older rules apply).
    assert of_another_store(chat_labels("t", "wf"), "store-b") is None
    assert of_another_store(labels, None) is None

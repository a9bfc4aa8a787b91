"""The pure verdicts, one observation at a time: what no emulator run can show cheaply
(DNS, timeouts, newer schemas, odd builds) and the report's own rules."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from pydantic import SecretStr

from prefect_coder.doctor import coder_verdicts as cv
from prefect_coder.doctor import local_verdicts as lv
from prefect_coder.doctor.build import infer_build
from prefect_coder.doctor.checks import Check, Report, Status
from prefect_coder.doctor.observed import (
    Answer,
    CoderObserved,
    Failure,
    PrefectObserved,
    SmokeObserved,
    StoreObserved,
)
from prefect_coder.doctor.probe import classify
from prefect_coder.doctor.target import from_flags

from .helpers import assert_no_secret

ENV = {"CODER_URL": "https://coder.example.com", "CODER_SESSION_TOKEN": "t0k", "CODER_ORG_ID": ""}


def target(**env: str):  # type: ignore[no-untyped-def]
    t, _ = from_flags({**ENV, **env})
    assert t is not None
    return t


def answer(status: int | None, path: str = "/api/v2/chats", **kw: object) -> Answer:
    return Answer("GET", path, status=status, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("v2", "exp", "status_q", "build", "problem"),
    [
        (200, 200, 400, "B1", None),
        (200, 200, 200, "B2", None),
        (200, 404, 200, "B3", None),
        (200, 404, 400, None, "unrecognised"),
        (404, 200, 400, None, "experimental-only"),
        (404, 404, 404, None, "no-chat-api"),
    ],
)
def test_build_table(
    v2: int, exp: int, status_q: int, build: str | None, problem: str | None
) -> None:
    guess = infer_build(answer(v2), answer(exp), answer(status_q))
    assert (guess.build, guess.problem) == (build, problem)


def test_dns_failure_and_timeout_name_their_fix() -> None:
    try:
        try:
            raise socket.gaierror(-2, "Name or service not known")
        except socket.gaierror as inner:
            raise httpx.ConnectError("[Errno -2] Name or service not known") from inner
    except httpx.ConnectError as exc:
        kind, text = classify(exc)
    assert kind is Failure.DNS and "Name or service not known" in text
    t = target()
    obs = CoderObserved(
        t.base_url, True, answer(None, "/api/v2/buildinfo", failure=kind, detail=text)
    )
    check = cv.server(obs, t)
    assert check.status is Status.FAIL
    assert "the host name 'coder.example.com' does not resolve here" in check.fix
    timeout = CoderObserved(
        t.base_url, True, answer(None, "/api/v2/buildinfo", failure=Failure.TIMEOUT)
    )
    assert "no answer in time" in cv.server(timeout, t).fix


def test_server_warnings() -> None:
    plain = target(CODER_URL="http://coder.internal:3000")
    ok = answer(200, "/api/v2/buildinfo", body={"version": "v2.30.0"})
    check = cv.server(CoderObserved(plain.base_url, True, ok), plain)
    assert check.status is Status.WARN and "unencrypted" in check.found
    loop = target(CODER_URL="http://127.0.0.1:3000")
    assert cv.server(CoderObserved(loop.base_url, True, ok), loop).status is Status.OK
    html = answer(200, "/api/v2/buildinfo", body=None)
    check = cv.server(CoderObserved(plain.base_url, True, html), plain)
    assert check.status is Status.WARN and "not like Coder" in check.found


def test_limits() -> None:
    t = target()
    assert cv.limits(t).status is Status.WARN  # no fleet cap
    from dataclasses import replace

    assert cv.limits(replace(t, max_concurrent_turns=5)).status is Status.OK
    high = cv.limits(replace(t, max_concurrent_turns=8))
    assert high.status is Status.WARN and "above the default" in high.found


def test_store_verdicts() -> None:
    base = StoreObserved("the default store", expected_version=4, url="u", tenant="default")
    from dataclasses import replace

    pg = replace(base, backend="postgresql", has_tables=True)
    assert lv.store(replace(pg, version=4)).status is Status.OK
    newer = lv.store(replace(pg, version=5))
    assert newer.status is Status.FAIL and "upgrade prefect-coder" in newer.fix
    older = lv.store(replace(pg, version=3))
    assert older.status is Status.WARN and "upgrade them together" in older.found
    lite = lv.store(replace(base, backend="sqlite", has_tables=True, version=4))
    assert lite.status is Status.WARN
    assert "fine for one machine; several workers need PostgreSQL" in lite.found
    bad = lv.store(replace(base, config_error="url: unsupported scheme 'mysql'"))
    assert bad.status is Status.FAIL and "url: unsupported scheme" in bad.found


def test_prefect_without_api_url_warns_and_skips_automations() -> None:
    obs = PrefectObserved(api_url=None, automation_name=lv.ZOMBIE_AUTOMATION)
    assert lv.prefect_api(obs).status is Status.WARN
    assert lv.automations(obs) is None
    down = PrefectObserved(api_url="http://p/api", error="ConnectError: refused")
    assert lv.prefect_api(down).status is Status.FAIL
    assert lv.automations(down) is None
    off = PrefectObserved(
        api_url="http://p/api", automation_name="x", automation_found=True, automation_enabled=False
    )
    check = lv.automations(off)
    assert check is not None and "disabled" in check.found and "--name 'x'" in check.fix


def test_smoke_verdicts() -> None:
    failed = cv.smoke(
        SmokeObserved("c1", error="missing_key: no key", error_kind="missing_key", archived=True)
    )
    assert failed.status is Status.FAIL and "add one in Coder's AI settings" in failed.fix
    left = cv.smoke(SmokeObserved("c1", reply="pong", latency_s=0.5, cleanup_error="409"))
    assert left.status is Status.FAIL and "could not be archived" in left.found
    ok = cv.smoke(SmokeObserved("c1", reply="pong", latency_s=0.5, archived=True))
    assert ok.status is Status.OK and "reply 'pong' in 0.50 s" in ok.found


def test_settings_from_flags_never_keep_the_token_visible() -> None:
    t, check = from_flags({**ENV, "CODER_SESSION_TOKEN": "tk-SECRET-xyz"})
    assert t is not None and check.status is Status.OK
    assert isinstance(t.token, SecretStr) and "tk-SECRET" not in repr(t)
    _, check = from_flags({**ENV, "CODER_SESSION_TOKEN": "two words"})
    assert check.status is Status.FAIL and "whitespace" in check.found
    _, check = from_flags({**ENV, "CODER_URL": "ftp://coder"})
    assert check.status is Status.FAIL and "base_url" in check.found


def test_report_exit_code_json_and_redaction() -> None:
    checks = (
        Check("a", Status.OK, "fine"),
        Check("b", Status.WARN, "meh\nsecond line", "do x"),
    )
    assert Report(checks).exit_code == 0
    report = Report((*checks, Check("c", Status.FAIL, "got tk-SECRET-xyz back", "fix")))
    assert report.exit_code == 1
    # One line per check, even for a multi-line text.
    assert len(report.text().splitlines()) == 4
    data = json.loads(report.redacted(["tk-SECRET-xyz"]).json())
    assert data["ok"] is False and data["counts"] == {"OK": 1, "WARN": 1, "FAIL": 1}
    assert data["checks"][2]["found"] == "got *** back"


def test_the_secret_scan_finds_a_piece() -> None:
    with pytest.raises(AssertionError, match="leaked"):
        assert_no_secret("header: Q9xk2Lm7 ...", "tk-Q9xk2Lm7Zt4")
    assert_no_secret("nothing here", "tk-Q9xk2Lm7Zt4")

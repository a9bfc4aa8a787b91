"""Issue 30: the Prefect API stopped and restarted while a workflow runs, with real
parts — a private Prefect server process (uvicorn on Prefect's app, its own SQLite
database and ``PREFECT_HOME``: ``prefect_server_proc.py``) killed with a real signal
and started again on the same port, and the workflow run by its own process
(``prefect_restart_child.py``: an ``agent_workflow`` flow run against that server),
against the thread-hosted emulator. Model time is held with scripted sleeps that the
test ends, so each outage falls exactly where it is meant to.

(a) SIGKILL between steps (step 1's turn settles and its task finishes while the API
    is gone; step 2's task run is created against the restarted server) and SIGTERM
    mid-step (step 2's model still generating): the run rides both out — Prefect's
    client retries its requests through the restart — and ends Completed.
(b) an outage longer than the client's retry budget (shortened here to one retry with
    ``PREFECT_CLIENT_MAX_RETRIES=1``; the default, 5 with backoff 2…32 s, rides out
    ≈ a minute): the flow-run process fails — its run left Running on the server, the
    reconciler's case — and a rerun of the same workflow id against the restarted
    server finishes it.

Both: every step's text, one user message per step marker (the emulator's log: no
step sent twice), one chat, archived at the end (none left live).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect_server_proc import PrivatePrefectServer, running_prefect_server

from coder_chat.emulator.server import Emulator
from prefect_coder.flows.common.params import step_marker
from prefect_coder.flows.common.results import result_key

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HOLD = {"sleep": 3600}  # a step's model "thinks" until the test ends its sleep


@pytest.fixture(scope="module")
def private_prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivatePrefectServer]:
    with running_prefect_server(tmp_path_factory.mktemp("private-prefect")) as server:
        yield server


@pytest.fixture
def api(private_prefect: PrivatePrefectServer) -> PrivatePrefectServer:
    if not private_prefect.running:
        private_prefect.start()
    return private_prefect


def _step(name: str, *, hold: bool) -> dict[str, Any]:
    script = [{**HOLD, "text": f"said {name}"}] if hold else [{"text": f"said {name}"}]
    return {"name": name, "prompt": f"Say {name}. #emu " + json.dumps(script)}


def _spawn(
    server: PrivatePrefectServer,
    emu: Emulator,
    tmp_path: Path,
    workflow_id: str,
    steps: list[dict[str, Any]],
    *,
    retries: int,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    cfg = {
        "base_url": emu.base_url,
        "token": emu.token,
        "organization_id": emu.organization_id,
        "store_url": f"sqlite+aiosqlite:///{tmp_path}/state.db",
        "suffix": workflow_id,
        "workflow_id": workflow_id,
        "steps": steps,
        "retries": retries,
    }
    child_env = {
        **server.env(),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, str(HERE / "prefect_restart_child.py"), json.dumps(cfg)],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / f"{workflow_id}.stderr").open("w"),
        text=True,
    )


def _report(proc: subprocess.Popen[str], tmp_path: Path, workflow_id: str) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, (tmp_path / f"{workflow_id}.stderr").read_text()[-3000:]
    return dict(json.loads(lines[-1]))


def _wait(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _chats(emu: Emulator, workflow_id: str) -> list[dict[str, Any]]:
    return [c for c in emu.chats() if workflow_id in json.dumps(c.get("labels") or {})]


def _user_messages(emu: Emulator, workflow_id: str, step: str) -> int:
    marker = step_marker(workflow_id, step)
    return sum(
        marker in json.dumps(m["content"])
        for c in _chats(emu, workflow_id)
        for m in emu.messages(c["id"], include_system=False)
        if m["role"] == "user"
    )


def _sleeping_on(emu: Emulator, workflow_id: str, step: str) -> bool:
    """The step's prompt has landed and its model is inside the scripted sleep."""
    return _user_messages(emu, workflow_id, step) >= 1 and any(
        c.get("sleeping") for c in _chats(emu, workflow_id)
    )


def _answered(emu: Emulator, workflow_id: str, step: str) -> bool:
    return any(
        m["role"] == "assistant" and f"said {step}" in json.dumps(m["content"])
        for c in _chats(emu, workflow_id)
        for m in emu.messages(c["id"], include_system=False)
    )


def _flow_runs(server: PrivatePrefectServer, workflow_id: str) -> list[dict[str, Any]]:
    r = httpx.post(f"{server.api_url}/flow_runs/filter", json={"limit": 50}, timeout=10)
    r.raise_for_status()
    return [run for run in r.json() if run["name"] == workflow_id]


def _assert_done_once(
    server: PrivatePrefectServer, emu: Emulator, workflow_id: str, steps: list[str]
) -> None:
    [chat] = _chats(emu, workflow_id)
    for name in steps:
        assert _user_messages(emu, workflow_id, name) == 1, name  # never sent twice
        # No result lost: each step's record in the flow-run process's result storage.
        record = server.home / "storage" / result_key(workflow_id, name)
        assert f"said {name}" in json.loads(record.read_text())["result"], name
    assert emu.chat(chat["id"])["archived"]  # no chat left live


def test_api_restarted_between_steps_and_mid_step_the_run_rides_it_out(
    api: PrivatePrefectServer, chatd_emulator: Emulator, tmp_path: Path
) -> None:
    emu = chatd_emulator
    workflow_id = f"pr-a-{uuid.uuid4().hex[:8]}"
    steps = [_step("one", hold=True), _step("two", hold=True), _step("three", hold=False)]
    proc = _spawn(api, emu, tmp_path, workflow_id, steps, retries=0)
    try:
        # Between steps: the API dies while step 1's model thinks; step 1 then settles,
        # and its task's end and step 2's task-run creation meet the dead API.
        _wait("step one in flight", lambda: _sleeping_on(emu, workflow_id, "one"))
        began = time.monotonic()
        api.kill(signal.SIGKILL)
        assert emu.end_sleeps() == 1
        _wait("step one answered", lambda: _answered(emu, workflow_id, "one"))
        time.sleep(0.5)  # the child's next API calls hit the closed port
        api.start()
        print(f"between-steps outage: {time.monotonic() - began:.1f} s")
        # Mid-step: SIGTERM while step 2's model thinks, back before it answers.
        _wait("step two in flight", lambda: _sleeping_on(emu, workflow_id, "two"))
        began = time.monotonic()
        api.kill(signal.SIGTERM)
        time.sleep(0.5)
        api.start()
        print(f"mid-step outage: {time.monotonic() - began:.1f} s")
        assert emu.end_sleeps() == 1
        report = _report(proc, tmp_path, workflow_id)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert report.get("state") == "COMPLETED", report
    assert report["texts"] == ["said one", "said two", "said three"]
    _assert_done_once(api, emu, workflow_id, ["one", "two", "three"])
    [run] = _flow_runs(api, workflow_id)
    assert run["state_type"] == "COMPLETED"


def _first_report(proc: subprocess.Popen[str], tmp_path: Path, workflow_id: str) -> dict[str, Any]:
    """The child's report line as soon as it is printed; then the process is killed.

    With the API gone, a flow-run process spends ≈ 7 s per queued event at exit
    trying to deliver it (Prefect's events worker drains at exit): a minute for
    this run's few events. The events are lost either way; the test need not wait."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("{"):
                proc.kill()
                proc.wait()
                return dict(json.loads(line))
            if not line and proc.poll() is not None:
                break
    proc.kill()
    proc.wait()
    raise AssertionError((tmp_path / f"{workflow_id}.stderr").read_text()[-3000:])


def test_api_down_until_the_run_ends_then_a_rerun_completes_it(
    api: PrivatePrefectServer, chatd_emulator: Emulator, tmp_path: Path
) -> None:
    emu = chatd_emulator
    workflow_id = f"pr-b-{uuid.uuid4().hex[:8]}"
    steps = [_step("one", hold=True), _step("two", hold=False)]
    # One client retry (2 s) instead of five (≈ 62 s): the same outcome as a longer outage.
    proc = _spawn(
        api, emu, tmp_path, workflow_id, steps, retries=0, env={"PREFECT_CLIENT_MAX_RETRIES": "1"}
    )
    try:
        _wait("step one in flight", lambda: _sleeping_on(emu, workflow_id, "one"))
        api.kill(signal.SIGKILL)  # and not back until the run has ended
        assert emu.end_sleeps() == 1
        began = time.monotonic()
        report = _first_report(proc, tmp_path, workflow_id)
        print(f"the run's end without the API: {time.monotonic() - began:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    # Task-run states travel as events (buffered, and lost here): the steps ran, were
    # persisted and the chat archived without the API; only the flow run's own final
    # state needs it, and that write failed.
    print("the run, with the API gone:", report)
    assert report.get("state") != "COMPLETED", report
    _assert_done_once(api, emu, workflow_id, ["one", "two"])
    api.start()
    [first] = _flow_runs(api, workflow_id)
    assert first["state_type"] == "RUNNING"  # a zombie: the reconciler's case

    # What the reconciler (or a person) does with it: run the same workflow id again.
    began = time.monotonic()
    rerun = _spawn(api, emu, tmp_path, workflow_id, steps, retries=0)
    report = _report(rerun, tmp_path, workflow_id)
    print(f"rerun: {time.monotonic() - began:.1f} s")
    assert report.get("state") == "COMPLETED", report
    assert report["texts"] == ["said one", "said two"]
    _assert_done_once(api, emu, workflow_id, ["one", "two"])  # nothing sent again

"""What a workflow leaves behind — logs, artifacts, events, results, store — is useful
and never contains the token."""

from __future__ import annotations

import asyncio
from pathlib import Path

from flow_helpers import TOKEN, emu_directive, say
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import LogSort

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.observe.artifacts import artifact_key


def _read_all(root: Path, pattern: str) -> list[str]:
    return [p.read_bytes().decode(errors="replace") for p in root.rglob(pattern) if p.is_file()]


async def _events(client: object, workflow_id: str) -> list[dict]:
    flt = {
        "event": {"prefix": ["coder."]},
        "any_resource": {"id": [f"coder.workflow.{workflow_id}"]},
        "order": "ASC",
    }
    resp = await client._client.post(  # type: ignore[attr-defined]
        "/events/filter", json={"filter": flt, "limit": 50}
    )
    resp.raise_for_status()
    return list(resp.json()["events"])


async def test_observability_is_published_and_the_token_is_nowhere(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    prefect_env: object,
    sqlite_block: str,
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    steps = [
        Step(
            name="tool",
            prompt="use the tool"
            + emu_directive(
                [
                    {
                        "tool_calls": [
                            {"name": "record_note", "args": {"title": "t", "body": "b c"}}
                        ]
                    },
                    {"text": "noted"},
                ]
            ),
            tools=["record_note"],
        ),
        Step(name="plain", prompt="and now" + say("done")),
    ]
    # a redial on the way: the stream drops once mid-turn and self-heals
    emu.faults.drop_next_stream(after_frames=2, count=1)
    results = await agent_workflow(workflow_id, steps, settings)
    emu.faults.clear()
    chat_id = results[0].chat_id

    haystacks: list[str] = []
    async with get_client() as client:
        # events arrive asynchronously through the events worker and the server's
        # event persister (it flushes every few seconds): a look every 0.25 s (each
        # read costs the shared test server CPU), bounded at 10 s
        for _ in range(40):
            events = await _events(client, workflow_id)
            mine = [e for e in events if e["payload"].get("workflow_id") == workflow_id]
            seen = [e["event"] for e in mine]
            # all of them: the events worker may deliver one step's settle after the archive
            if seen.count("coder.turn.settled") >= 2 and "coder.chat.archived" in seen:
                break
            await asyncio.sleep(0.25)
        names = [e["event"] for e in mine]
        assert names.count("coder.turn.settled") == 2
        assert "coder.stream.redial" in names
        settled = next(e for e in mine if e["event"] == "coder.turn.settled")
        assert settled["resource"]["prefect.resource.id"] == f"coder.chat.{chat_id}"
        haystacks += [str(e) for e in events]

        artifacts = await client.read_artifacts()
        turn_md = [a for a in artifacts if a.key == artifact_key(workflow_id, "tool")]
        assert turn_md and "record_note" in str(turn_md[0].data)
        haystacks += [str(a.data) for a in artifacts]

        # logs are shipped in batches (every 2 s) by a background worker: poll for
        # ours every 0.25 s (a read of 200 logs each), bounded at 10 s
        for _ in range(40):
            logs = await client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)
            messages = [log.message for log in logs]
            if any("stream redial" in m and chat_id in m for m in messages):
                break
            await asyncio.sleep(0.25)
        assert any("stream redial" in m and chat_id in m for m in messages)
        haystacks += messages

        runs = await client.read_flow_runs()
        haystacks += [str(r.parameters) + str(r.state) for r in runs]
        tasks = await client.read_task_runs()
        haystacks += [str(t.state) for t in tasks]

    results = await asyncio.to_thread(_read_all, prefect_env.results_dir, "*")  # type: ignore[attr-defined]
    assert results, "no persisted results found"
    haystacks += results
    block = await ChatStateStore.aload(sqlite_block)
    db = Path(str(block.url).split("///", 1)[1])
    stored = await asyncio.to_thread(_read_all, db.parent, db.name + "*")  # db + WAL
    assert stored
    haystacks += stored

    assert all(TOKEN not in h for h in haystacks)

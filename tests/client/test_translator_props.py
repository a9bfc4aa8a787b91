"""Property: for any drop schedule, the turn's text and usage equal the fault-free
run's and no delta is emitted twice.

A simulated chatd timeline (user prompt, N assistant steps streamed as deltas
and then committed, terminal status) is delivered with outages: events inside
an outage are lost; each reconnect delivers what chatd sends on connect
(messages past the original ``after_id``, status, ``preview_reset``, and the
open episode's deltas from seq 1), passed through the stream layer's real
``ReplayFilter``.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coder_chat.core.dedup import ReplayFilter
from coder_chat.core.translator import QueuedGate, ReasoningDelta, TextDelta, TurnTranslator

Step = tuple[list[str], list[str], dict[str, int]]  # text chunks, reasoning chunks, usage


def timeline(steps: list[Step], user_id: int) -> list[tuple[str, Any]]:
    """Server-side history of a turn: ('event', ev) items plus commit markers."""
    out: list[tuple[str, Any]] = [
        ("commit", {"id": user_id, "role": "user", "content": [{"type": "text", "text": "go"}]}),
        ("event", {"type": "status", "status": {"status": "running"}}),
    ]
    mid = user_id
    for hv, (chunks, rchunks, usage) in enumerate(steps, start=2):
        seq = 0
        for kind, cs in (("reasoning", rchunks), ("text", chunks)):
            for c in cs:
                seq += 1
                out.append(("delta", (hv, seq, kind, c)))
        mid += 1
        content = []
        if rchunks:
            content.append({"type": "reasoning", "text": "".join(rchunks)})
        content.append({"type": "text", "text": "".join(chunks)})
        out.append(("commit", {"id": mid, "role": "assistant", "content": content, "usage": usage}))
    out.append(("event", {"type": "status", "status": {"status": "waiting"}}))
    return out


def delta_event(hv: int, seq: int, kind: str, text: str) -> dict[str, Any]:
    return {
        "type": "message_part",
        "message_part": {
            "role": "assistant",
            "part": {"type": kind, "text": text},
            "history_version": hv,
            "generation_attempt": 1,
            "seq": seq,
        },
    }


def deliver(tl: list[tuple[str, Any]], outages: list[tuple[int, int]], after_id: int) -> list[Any]:
    """What the consumer sees (after replay dedup) with the given outages."""
    lost: set[int] = set()
    reconnect_at: dict[int, int] = {}
    for start, length in outages:
        end = min(start + length, len(tl))
        for i in range(start, end):
            lost.add(i)
        reconnect_at.setdefault(end, end)
    filt = ReplayFilter(after_id)
    seen: list[Any] = []
    committed: dict[int, dict[str, Any]] = {}
    status: str | None = None
    open_episode: list[tuple[int, int, str, str]] = []

    def forward(ev: dict[str, Any]) -> None:
        if ev["type"] == "message_part":
            mp = ev["message_part"]
            if not filt.observe_delta(
                mp["history_version"], mp["generation_attempt"], mp["seq"]
            ).forward:
                return
        seen.append(ev)

    for i, (kind, item) in enumerate(tl):
        if i in reconnect_at and i > 0 and (i - 1) in lost:
            # connect-time snapshot at this point of the server timeline
            for mid in sorted(committed):
                if mid > after_id:
                    forward({"type": "message", "message": committed[mid]})
            if status is not None:
                forward({"type": "status", "status": {"status": status}})
            forward({"type": "preview_reset"})
            for d in open_episode:
                forward(delta_event(*d))
        # server state advances regardless of the client
        if kind == "commit":
            committed[item["id"]] = item
            open_episode = []
        elif kind == "delta":
            open_episode.append(item)
        elif kind == "event" and item["type"] == "status":
            status = item["status"]["status"]
        if i in lost:
            continue
        if kind == "commit":
            forward({"type": "message", "message": item})
            forward({"type": "preview_reset"})
        elif kind == "delta":
            forward(delta_event(*item))
        else:
            forward(item)
    # a drop at the very end: the final reconnect snapshot
    if len(tl) in reconnect_at and (len(tl) - 1) in lost:
        for mid in sorted(committed):
            if mid > after_id:
                forward({"type": "message", "message": committed[mid]})
        if status is not None:
            forward({"type": "status", "status": {"status": status}})
    return seen


def run(events: list[Any], cursor: int) -> tuple[TurnTranslator, list[Any]]:
    tr = TurnTranslator(cursor=cursor)
    emitted: list[Any] = []
    for ev in events:
        emitted.extend(tr.feed(ev))
        if tr.settled:
            break
    emitted.extend(tr.finish())
    return tr, emitted


chunk = st.text(alphabet="abcxyz ", min_size=1, max_size=4)
step = st.tuples(
    st.lists(chunk, min_size=0, max_size=6),
    st.lists(chunk, min_size=0, max_size=3),
    st.fixed_dictionaries(
        {"input_tokens": st.integers(0, 50), "output_tokens": st.integers(0, 50)}
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(step, min_size=1, max_size=3),
    outages=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=4),
    fresh=st.booleans(),
)
def test_drops_cost_latency_never_content(
    steps: list[Step], outages: list[tuple[int, int]], fresh: bool
) -> None:
    user_id = 10
    tl = timeline(steps, user_id)
    cursor = 0 if fresh else user_id
    clean_tr, _clean_out = run(deliver(tl, [], cursor), cursor)
    tr, out = run(deliver(tl, outages, cursor), cursor)

    expected_text = "".join("".join(s[0]) for s in steps)
    expected_reasoning = "".join("".join(s[1]) for s in steps)
    assert clean_tr.text == expected_text
    assert tr.text == expected_text
    assert tr.reasoning == expected_reasoning
    assert tr.usage == clean_tr.usage
    assert tr.usage.output_tokens == sum(s[2]["output_tokens"] for s in steps)
    # no delta emitted twice: the emitted stream concatenates to the text exactly
    assert "".join(p.text for p in out if isinstance(p, TextDelta)) == expected_text
    assert "".join(p.text for p in out if isinstance(p, ReasoningDelta)) == expected_reasoning
    assert tr.finish_reason == "stop" and tr.raw_status == "waiting"


def _run_turn(mid: int, chunks: list[str], hv: int, usage: dict[str, int]) -> list[Any]:
    evs: list[Any] = [{"type": "status", "status": {"status": "running"}}]
    evs += [delta_event(hv, i + 1, "text", c) for i, c in enumerate(chunks)]
    evs.append(
        {
            "type": "message",
            "message": {
                "id": mid,
                "role": "assistant",
                "content": [{"type": "text", "text": "".join(chunks)}],
                "usage": usage,
            },
        }
    )
    return evs


def _user(mid: int, text: str, stamp: int | None) -> dict[str, Any]:
    m: dict[str, Any] = {"id": mid, "role": "user", "content": [{"type": "text", "text": text}]}
    if stamp is not None:
        m["queued_message_id"] = stamp
    return {"type": "message", "message": m}


def _queue(*ids: int) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "queue_update"}
    if ids:
        ev["queued_messages"] = [{"id": i, "content": [{"type": "text", "text": "p"}]} for i in ids]
    return ev


@settings(max_examples=200, deadline=None)
@given(
    pred=st.lists(chunk, min_size=1, max_size=5),
    decoy=st.one_of(st.none(), st.lists(chunk, min_size=1, max_size=5)),
    ours=st.lists(chunk, min_size=1, max_size=5),
    stamped=st.booleans(),
    entry_known=st.booleans(),
)
def test_queued_turn_attributes_only_its_own_run(
    pred: list[str], decoy: list[str] | None, ours: list[str], stamped: bool, entry_known: bool
) -> None:
    """A queued prompt behind a running predecessor (and possibly behind another
    job's prompt with IDENTICAL content) attributes exactly its own run."""
    prompt = "same prompt"
    our_qid, decoy_qid = 8, 7
    tr = TurnTranslator(
        cursor=20,
        queued=QueuedGate(our_qid if entry_known else None, [{"type": "text", "text": prompt}]),
    )
    events: list[Any] = [_queue(decoy_qid, our_qid) if decoy else _queue(our_qid)]
    events += _run_turn(21, pred, 2, {"output_tokens": 100})
    mid = 22
    if decoy is not None:
        events.append(_user(mid, prompt, decoy_qid if stamped else None))
        events.append(_queue(our_qid))
        events += _run_turn(mid + 1, decoy, 3, {"output_tokens": 50})
        mid += 2
    ours_user = mid
    events.append(_user(ours_user, prompt, our_qid if stamped else None))
    events.append(_queue())
    events += _run_turn(ours_user + 1, ours, 4, {"output_tokens": 7})
    events.append({"type": "status", "status": {"status": "waiting"}})
    for ev in events:
        tr.feed(ev)
    if decoy is not None and not entry_known:
        # Without our entry id, identical content is indistinguishable (stamps
        # cannot be matched either): the first match anchors (spec §3.3 limit).
        assert tr.effective_cursor == 22
        return
    assert tr.failure is None
    assert tr.effective_cursor == ours_user
    assert tr.text == "".join(ours)
    assert tr.usage.output_tokens == 7
    assert tr.finish_reason == "stop" and tr.raw_status == "waiting"

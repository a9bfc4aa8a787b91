"""Shared machinery of the crash-matrix tests and the recovery benchmark.

A two-step workflow; each step charges the test payments service through the
crash-safe ``charge_card`` tool, then answers. A child process runs the workflow
and SIGKILLs itself at a named crash point (``crash_child.py``, forked from a warm
Python process: ``ForkServer``); recovery then
runs either as a plain rerun of the workflow (``run_turn`` recovers
automatically) or through the ``recover-turn`` flow followed by the rerun.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # tests/: warm_python

from warm_python import WarmPython  # noqa: E402


def directive(script: Any) -> str:
    return " #emu " + json.dumps(script)


def charge_script(cents: int, text: str) -> dict[str, Any]:
    return {
        "text": text,
        "deltas": 6,
        "delay": 0.02,
        "tool_calls": [{"name": "charge_card", "args": {"amount_cents": cents}}],
    }


STEPS = [
    Step(
        name="plan",
        prompt="Charge the deposit." + directive(charge_script(100, "Charging the deposit.")),
        tools=["charge_card"],
    ),
    Step(
        name="pay",
        prompt="Charge the rest." + directive(charge_script(250, "Charging the rest now.")),
        tools=["charge_card"],
    ),
]


@dataclass(frozen=True)
class Case:
    """One row of the matrix: crash points of successive child runs, or a fault."""

    name: str
    crashes: tuple[str, ...] = ()
    #: Emulator fault armed for the first child run: the "POST landed, response lost"
    #: window on the step's message send, or on the chat's creation.
    fault: str | None = None
    #: Steps that may legitimately carry a second user turn (the documented window).
    may_resubmit: frozenset[str] = field(default_factory=frozenset)
    #: How many extra user turns such a step may carry: one per crash or failure that
    #: cut a live attempt short (the model continues from each aborted attempt).
    extra_turns: int = 1


CASES = [
    Case("before the chat exists", ("turn.before_create:1",)),
    Case("after create, before the checkpoint", ("turn.after_create:1",)),
    Case(
        "after the checkpoint, mid-stream", ("turn.mid_stream:2",), may_resubmit=frozenset({"pay"})
    ),
    Case(
        "first turn mid-stream (eager checkpoint)",
        ("turn.mid_stream:1",),
        may_resubmit=frozenset({"plan"}),
    ),
    Case("after the send write-ahead, before the request leaves", ("turn.sending:1",)),
    Case("inside a client tool, before its effect", ("tool.before_effect:2",)),
    Case("first turn, inside the tool (eager checkpoint)", ("tool.before_effect:1",)),
    Case("after the effect, before done", ("tool.after_effect:2",)),
    Case("after done, before submission", ("tool.after_done:2",)),
    Case("after submission, before the result is persisted", ("turn.before_persist:2",)),
    Case(
        "recovery: between the verdict and the interrupt",
        ("turn.mid_stream:2", "recovery.after_verdict:1"),
        may_resubmit=frozenset({"pay"}),
    ),
    Case(
        "recovery: between a resumed verdict and its submission",
        ("tool.after_done:2", "recovery.after_verdict:1"),
    ),
    # The mid-stream pause's call never ran: recovery runs it through the ledger and
    # submits (the crashed attempt is answered, not cut short) — and dies right after
    # the submission; the next pass follows the revived run (journaled "resumed").
    Case(
        "a second crash during recovery",
        ("turn.mid_stream:2", "recovery.after_submit:1"),
        may_resubmit=frozenset({"pay"}),
    ),
    Case(
        "POST /messages landed, response lost",
        fault="drop_response",
        may_resubmit=frozenset({"pay"}),
    ),
    Case("POST /chats landed, response lost (orphan)", fault="drop_create"),
]


def arm_fault(emu: Emulator, fault: str | None) -> None:
    """Arm a case's emulator fault (global: run such cases alone)."""
    if fault == "drop_response":
        emu.faults.drop_response(1, method="POST", path="/messages")
    elif fault == "drop_create":
        # the first POST of the workflow is its chat's creation
        emu.faults.drop_response(1, method="POST", path="/chats")


def child_spec(
    workflow_id: str, settings: WorkflowSettings, *, steps: list[Step] | None = None
) -> str:
    return json.dumps(
        {
            "workflow_id": workflow_id,
            "steps": [s.model_dump(mode="json") for s in steps or STEPS],
            # keep the chat: a failed child must not archive it (its handler would)
            "settings": settings.model_copy(update={"keep_chat": True}).model_dump(mode="json"),
        }
    )


class ForkServer:
    """Crash-test runs, each in a fresh process forked from a warm Python process
    (``tests/warm_python.py``: the import of Prefect and the flows is paid once).

    ``warm``: a warm process to share (the session's ``warm_python`` fixture); its
    ``PREFECT_*`` environment must be ``env``'s, else each run starts a fresh
    interpreter (correct, but it pays the import). Without one, :meth:`start` starts
    a warm process of its own on ``env`` and :meth:`stop` ends it. Every run's
    stderr is appended to ``stderr_path`` (:meth:`stderr_tail`).

    ``results_dir``: the runs store their Prefect results there (another worker's
    local storage), not in the session's result directory — set in each child
    (``crash_child.py``), so the runs still fork from the session's warm process
    (a different ``PREFECT_RESULTS_LOCAL_STORAGE_PATH`` in the environment would
    need a warm process of its own: one more Prefect import)."""

    def __init__(
        self,
        env: dict[str, str],
        stderr_path: Path,
        warm: WarmPython | None = None,
        *,
        results_dir: Path | None = None,
    ) -> None:
        self.env = dict(env)
        if results_dir is not None:
            self.env["CRASH_RESULTS_DIR"] = str(results_dir)
        self.stderr_path = stderr_path
        self._warm = warm
        self._own = warm is None

    async def start(self, ready_s: float = 60) -> None:
        """Start (or check) the warm process; ``TimeoutError`` if it is not ready in
        ``ready_s`` (a heavily loaded machine: callers may retry)."""
        if self._warm is None:
            self._warm = WarmPython(self.env)
        if not await asyncio.to_thread(self._warm.wait_ready, ready_s):
            raise TimeoutError(
                f"the warm Python process was not ready in {ready_s:g} s: "
                + self._warm.server_stderr()
            )

    @property
    def forks(self) -> int:
        """How many runs were forked from the warm process (the rest were fresh)."""
        return 0 if self._warm is None else self._warm.forks

    async def run(self, crash_at: str, spec: str, *, limit_s: float = 120) -> int:
        """Run the workflow in a fresh forked process that SIGKILLs itself at
        ``crash_at`` (empty: never); its exit code (-9 = killed, 0 finished, 3 raised).
        ``TimeoutError`` (the child killed) if it runs longer than ``limit_s``."""
        assert self._warm is not None, "start() first"
        env = {**self.env, "CRASH_AT": crash_at, "CRASH_SPEC": spec}
        child = await asyncio.to_thread(
            self._warm.start, [str(HERE / "crash_child.py")], env=env, cwd=HERE.parents[1]
        )
        try:
            done = await child.communicate(limit_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"crash child {crash_at!r} ran past {limit_s:g} s") from None
        if done.stdout or done.stderr:
            with self.stderr_path.open("a", errors="replace") as log:
                log.write(done.stdout + done.stderr)
        return done.returncode

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def stop(self) -> None:
        if self._own and self._warm is not None:
            await asyncio.to_thread(self._warm.close)
            self._warm = None


async def run_workflow(
    workflow_id: str, steps: list[Step], settings: WorkflowSettings
) -> list[Any]:
    """``agent_workflow`` whose steps are all agent turns: their ``TurnResult`` list."""
    from prefect_coder.flows.common.results import TurnResult
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    results = await agent_workflow(workflow_id, steps, settings)
    assert all(isinstance(r, TurnResult) for r in results), results
    return list(results)


def chats_of(emu: Emulator, workflow_id: str) -> list[dict[str, Any]]:
    """Every chat (incl. archived) that carries one of the workflow's markers."""
    markers = [step_marker(workflow_id, s.name) for s in STEPS]
    out = []
    for chat in emu.chats():
        texts = user_texts(emu, chat["id"])
        if any(m in t for t in texts for m in markers):
            out.append(chat)
    return out


async def crash(server: ForkServer, point: str, spec: str) -> None:
    """Run the workflow in a fresh forked process that SIGKILLs itself at ``point``;
    fail (with the children's stderr) unless the kill is what ended it."""
    rc = await server.run(point, spec)
    assert rc == -9, (point, rc, server.stderr_tail())


async def workflow_chat(emu: Emulator, workflow_id: str, *, status: str | None = None) -> str:
    """The id of the workflow's one chat (archived ones count), once it shows
    ``status`` (e.g. the state a crashed or failed attempt left on the server) if
    given."""
    chats = chats_of(emu, workflow_id)
    assert len(chats) == 1, chats
    chat_id = str(chats[0]["id"])
    if status is not None:
        await emu.await_status(chat_id, status)
    return chat_id


async def crash_to_chat(
    server: ForkServer,
    point: str,
    spec: str,
    emu: Emulator,
    workflow_id: str,
    *,
    status: str | None = None,
) -> str:
    """:func:`crash`, then :func:`workflow_chat`."""
    await crash(server, point, spec)
    return await workflow_chat(emu, workflow_id, status=status)


def crash_settings(coder_block: str, store_block: str, **update: Any) -> WorkflowSettings:
    """The crash tests' workflow settings: no task retries (recovery is the rerun's),
    a dead run's lease lapsing after 1 s, short settle and redial waits, the payments
    tool; ``update`` overrides fields (e.g. a test's own request timeout)."""
    return WorkflowSettings(
        credentials_block=coder_block,
        store_block=store_block,
        retries=0,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=1,
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=False,
        tool_modules=["prefect_coder.flows.demo_tools", "payment_tools"],
    ).model_copy(update=update)


def user_texts(emu: Emulator, chat_id: str) -> list[str]:
    out = []
    for m in emu.messages(chat_id, include_system=False):
        if m.get("role") == "user":
            out.append(
                "".join(
                    p.get("text", "") for p in m.get("content") or [] if p.get("type") == "text"
                )
            )
    return out


def charge_calls(emu: Emulator, chat_id: str) -> list[str]:
    """The chat's ``charge_card`` call ids, in history order."""
    return [
        p["tool_call_id"]
        for m in emu.messages(chat_id, include_system=False)
        for p in m.get("content") or []
        if p.get("type") == "tool-call" and p.get("tool_name") == "charge_card"
    ]


def turn_record(
    emu: Emulator, chat_id: str, user_message_id: int
) -> tuple[list[int], dict[str, int]]:
    """What ``generate()`` records of the turn a user message started, read from the
    emulator's stored rows: the ids of its assistant and tool messages (up to the
    chat's next user message) and the wire usage of its assistant messages, summed
    (``input_tokens`` here is the wire's uncached count: ``no_cache_input_tokens``
    of a result's ``usage``)."""
    ids: list[int] = []
    usage: dict[str, int] = {}
    rows = [m for m in emu.messages(chat_id, include_system=False) if not m.get("deleted")]
    for m in sorted(rows, key=lambda r: int(r["id"])):
        if int(m["id"]) <= user_message_id:
            continue
        if m["role"] == "user":
            break
        if m["role"] in ("assistant", "tool"):
            ids.append(int(m["id"]))
        if m["role"] == "assistant" and m.get("usage"):
            for key in ("input_tokens", "output_tokens", "total_tokens"):
                usage[key] = usage.get(key, 0) + int(m["usage"].get(key) or 0)
    return ids, usage


def effects_of(payments: Any, chat_ids: list[str]) -> dict[str, int]:
    with payments.lock:
        return {k: v for k, v in payments.effects.items() if any(f"/{c}/" in k for c in chat_ids)}


# ----------------------------------------------------------- the batched matrix rows

#: Chat states of a workflow that is not at rest.
LIVE = {"running", "pending", "requires_action", "interrupting", "paused"}
#: How the matrix recovers a crashed workflow (one test file per mode: see
#: :func:`crash_rows`).
MODES = ["rerun", "recover-turn"]


async def crash_case(
    case: Case,
    workflow_id: str,
    settings: WorkflowSettings,
    server: ForkServer,
    emu: Emulator,
) -> None:
    """Leave ``workflow_id`` as ``case`` says: its fault's failed run, then one child
    run SIGKILLed at each of its crash points in turn."""
    spec = child_spec(workflow_id, settings)
    if case.fault:
        # the request commits but its response never arrives
        arm_fault(emu, case.fault)
        try:
            rc = await server.run("", spec)
        finally:
            emu.faults.clear()
        assert rc == 3, (rc, server.stderr_tail())
    for i, point in enumerate(case.crashes):
        if i:
            # A second crash point inside recovery is reached only on the path the
            # crashed attempt leaves once the model is done streaming (a pause, or
            # rest); a child started while it still streams would follow it instead.
            # With eight children on a loaded machine that can take a while: wait.
            await _not_streaming(emu, workflow_id)
        rc = await server.run(point, spec)
        assert rc == -9, (point, rc, server.stderr_tail())


async def _not_streaming(emu: Emulator, workflow_id: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(c["status"] not in {"running", "pending"} for c in chats_of(emu, workflow_id)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{workflow_id}: a chat still streams after {within:g}s")


async def crash_rows(
    modes: list[str],
    settings: WorkflowSettings,
    server: ForkServer,
    emu: Emulator,
    *,
    concurrency: int = 8,
) -> dict[tuple[str, str], str]:
    """Crash every (case, mode) of ``modes`` once, children running concurrently (a
    child costs ≈ 2-4 s of flow start and turns); the workflow id of each row. Fault
    cases run alone first: an armed emulator fault is global.

    The matrix is one batch per mode and one test file per mode, so that under
    ``--dist loadfile`` the two batches run on two xdist workers side by side (a
    single batch of every row kept one worker busy for minutes while the other had
    finished its files)."""
    ids = {
        (c.name, m): f"r-mx-{i}-{MODES.index(m)}-{uuid.uuid4().hex[:6]}"
        for i, c in enumerate(CASES)
        for m in modes
    }
    for case in CASES:
        if case.fault:
            for m in modes:
                await crash_case(case, ids[case.name, m], settings, server, emu)
    gate = asyncio.Semaphore(concurrency)

    async def one(case: Case, mode: str) -> None:
        async with gate:
            await crash_case(case, ids[case.name, mode], settings, server, emu)

    await asyncio.gather(*(one(c, m) for c in CASES if not c.fault for m in modes))
    return ids


async def recover(case: Case, mode: str, workflow_id: str, settings: WorkflowSettings) -> list[Any]:
    """Recover a crashed workflow: a plain rerun, or ``recover-turn`` then the rerun
    (which then returns every step from storage)."""
    if mode == "recover-turn":
        from prefect_coder.flows.deployments.recover_turn import recover_turn

        report = await recover_turn(
            workflow_id, steps=STEPS, settings=settings, finish_workflow=True
        )
        assert report.action in ("nothing", "recovered", "ran"), report
        assert report.finished_workflow
    return await run_workflow(workflow_id, STEPS, settings)


async def recover_rows(
    crashed: dict[tuple[str, str], str], settings: WorkflowSettings, *, concurrency: int = 6
) -> dict[tuple[str, str], list[Any] | BaseException]:
    """Every crashed row recovered, concurrently (each in its own flow runs; they wait
    on nothing of each other's but the machine); a row's exception is its outcome,
    raised by the row's own test."""
    gate = asyncio.Semaphore(concurrency)

    async def one(key: tuple[str, str]) -> list[Any] | BaseException:
        case = next(c for c in CASES if c.name == key[0])
        async with gate:
            try:
                return await recover(case, key[1], crashed[key], settings)
            except Exception as exc:  # reported by the case's own test
                return exc

    keys = list(crashed)
    outcomes = await asyncio.gather(*(one(k) for k in keys))
    return dict(zip(keys, outcomes, strict=True))


async def check(
    case: Case,
    workflow_id: str,
    results: list[Any],
    baseline: list[str],
    payments: Any,
    emu: Emulator,
) -> None:
    """The matrix's invariants after recovery: the fault-free run's results; each
    payment effect once per key and one key per step; at most the case's extra user
    turns, only on the steps its window allows; no orphan (a first turn's chat
    created before a crash and never checkpointed is adopted by the recovery, not
    left beside a fresh one); nothing of the workflow left live."""
    assert [r.text for r in results] == baseline
    chats = chats_of(emu, workflow_id)
    ids = [c["id"] for c in chats]
    effects = effects_of(payments, ids)
    # exactly once per key, and one key (one effect) per step
    assert sorted(effects.values()) == [1, 1], effects
    main = results[-1].chat_id
    for s in STEPS:
        marker = step_marker(workflow_id, s.name)
        on_main = sum(marker in t for t in user_texts(emu, main))
        allowed = 1 + case.extra_turns if s.name in case.may_resubmit else 1
        assert 1 <= on_main <= allowed, (s.name, user_texts(emu, main))
    # The crashed first attempt's chat is the one the workflow ends on
    # (flows/recovery/orphans.py adopts it), never an orphan beside a fresh chat.
    assert ids == [main], [(c["id"], user_texts(emu, c["id"])) for c in chats]
    for _ in range(100):
        live = [c["id"] for c in chats_of(emu, workflow_id) if c["status"] in LIVE]
        if not live:
            break
        await asyncio.sleep(0.05)
    assert not live, [(c["id"], c["status"]) for c in chats_of(emu, workflow_id)]


def env_for_children(base: dict[str, str], payments_url: str) -> dict[str, str]:
    env = dict(base)
    env["PAYMENTS_URL"] = payments_url
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("CRASH_AT", None)
    return {k: v for k, v in env.items() if v is not None and k in env}


__all__ = [
    "CASES",
    "LIVE",
    "MODES",
    "STEPS",
    "Case",
    "arm_fault",
    "chats_of",
    "check",
    "child_spec",
    "crash",
    "crash_case",
    "crash_rows",
    "crash_settings",
    "crash_to_chat",
    "effects_of",
    "env_for_children",
    "os",
    "recover",
    "recover_rows",
    "run_workflow",
    "turn_record",
    "user_texts",
    "workflow_chat",
]

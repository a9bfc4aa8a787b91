"""Crash-recovery benchmark: time from a SIGKILL to the recovered result, per kill point.

    .venv/bin/python bench/recovery.py [--reps 3] [--horizon 2.0] [--lease-ttl 1.0] [--only TEXT]
    .venv/bin/python bench/recovery.py --deployed [--kills 20] [--host-losses 3] [--continuation 10]

``--deployed``: the deployed path (PostgreSQL-backed ``prefect server start``,
``prefect deploy --all``, process workers, the prefect.yaml Crashed triggers, the
zombie automation) with the deployments' default settings; see
``bench/recovery_deployed.py``. Without it, the in-process crash matrix below.

For each row of the crash matrix (tests/recovery/crash_matrix.py) a forked child
process runs the two-step workflow and SIGKILLs itself at the named point; then
the clock starts and a plain rerun of the workflow (``run_turn`` recovers
automatically) runs in this process until it returns the results. Reported:
median and max over ``--reps``. Everything runs on this machine: the chatd
emulator (thread), a real Prefect test server, SQLite, the test payments service.

What the numbers include: the wait for the crashed holder's workflow lease to
lapse (``--lease-ttl``; production default 60 s), Prefect's flow/task start,
the settle-wait (status probe, interrupt, 50 ms polls), ledger reconcile,
history reads, and — where recovery resubmits — the resubmitted turn itself.
What they exclude: the deliberate commit-horizon sleep. The matrix rows never
hit it (no row leaves a matching "submitting" entry), so it is set to 0 here;
the last row measures it separately on a chat with an unlanded resubmission:
the sleep is exactly what remains of the horizon, on top of the same work.

Per row it also tells how the crashed turn was finished — read from the
emulator, not from recovery's own report: ``followed`` (the chat was still live
when the rerun started and no second user turn appeared: recovery re-attached),
``recovered`` (at rest: rebuilt from history), ``resubmitted`` (a second user
turn with the step's marker), ``fresh chat`` (an orphan was swept, the step ran
on a new chat) — and at the end the share of crashed turns found
live that were finished by following instead of resubmitting. The extra row
"long continuation after a tool result" crashes right after a tool round while
the model keeps generating for ``--continuation`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "recovery"
sys.path[:0] = [str(ROOT), str(TESTS)]


async def main(args: argparse.Namespace) -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ["PREFECT_CODER_SETTLE_POLL_S"] = "0.05"
    os.environ["PREFECT_CODER_COMMIT_HORIZON_S"] = "0"
    from crash_matrix import (
        CASES,
        STEPS,
        Case,
        ForkServer,
        arm_fault,
        chats_of,
        child_spec,
        directive,
        env_for_children,
        user_texts,
    )
    from payments import running_payments
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_LOGGING_LEVEL,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness
    from pydantic import SecretStr

    from coder_chat.emulator import Emulator
    from coder_chat.models import ChatInputPart, CreateChatRequest
    from coder_chat.recovery import RecoveryTimings, TurnRecovery
    from coder_chat.rest import ChatClient
    from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore
    from prefect_coder.blocks.state import JournalEntry
    from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
    from prefect_coder.flows.common.results import TurnResult
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    logging.getLogger("coder_chat").setLevel(logging.WARNING)

    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    token = f"bench-{uuid.uuid4().hex}"
    with (
        temporary_settings(
            updates={
                PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp / "results",
                PREFECT_LOGGING_LEVEL: "ERROR",
            }
        ),
        prefect_test_harness(server_startup_timeout=240),
        Emulator.running_in_thread(tokens=[token], delta_delay=0.0, log_requests=False) as emu,
        running_payments() as payments,
    ):
        os.environ["PAYMENTS_URL"] = payments.url
        await CoderCredentials(
            base_url=emu.base_url,
            organization_id=uuid.UUID(emu.organization_id),
            token=SecretStr(token),
            request_timeout=30.0,
            turn_timeout=60.0,
        ).save("bench-coder", overwrite=True)
        await ChatStateStore(url=f"sqlite+aiosqlite:///{tmp / 'state.db'}").save(
            "bench-store", overwrite=True
        )
        settings = WorkflowSettings(
            credentials_block="bench-coder",
            store_block="bench-store",
            retries=0,
            lease_wait_s=60,
            lease_ttl_s=args.lease_ttl,
            settle_wait_s=15,
            redial_backoff_ms=20,
            artifacts=False,
            tool_modules=["prefect_coder.flows.demo_tools", "payment_tools"],
        )
        env = env_for_children(
            {
                **os.environ,
                "PREFECT_API_URL": str(PREFECT_API_URL.value()),
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp / "results"),
                "PREFECT_LOGGING_LEVEL": "ERROR",
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
            },
            payments.url,
        )
        server = ForkServer(env, tmp / "children.log")
        await server.start()
        t0 = time.perf_counter()
        await agent_workflow(f"bench-base-{uuid.uuid4().hex[:6]}", STEPS, settings)
        fault_free = time.perf_counter() - t0
        print(f"fault-free two-step workflow, in process: {fault_free * 1000:.0f} ms")
        print(f"lease ttl {args.lease_ttl:.1f} s (a killed holder's lease lapses after it)\n")
        long_pay = Step(
            name="pay",
            prompt="Charge the rest."
            + directive(
                {
                    "steps": [
                        {
                            "text": "Charging the rest now.",
                            "tool_calls": [{"name": "charge_card", "args": {"amount_cents": 250}}],
                        },
                        {"sleep": args.continuation, "text": "All paid."},
                    ]
                }
            ),
            tools=["charge_card"],
        )
        rows: list[tuple[Case, list[Step]]] = [(c, STEPS) for c in CASES]
        rows.append(
            (
                Case("long continuation after a tool result", ("turn.after_tool_results:2",)),
                [STEPS[0], long_pay],
            )
        )
        rows = [r for r in rows if not args.only or args.only in r[0].name]
        live_statuses = {"running", "pending", "requires_action", "interrupting", "paused"}
        totals = {"followed": 0, "recovered": 0, "resubmitted": 0, "fresh chat": 0}
        live_total = 0
        print(
            f"{'kill point':58s} {'median ms':>10s} {'max ms':>8s}  how the crashed turn finished"
        )
        try:
            for case, steps in rows:
                times = []
                how: dict[str, int] = {}
                for _ in range(args.reps):
                    wf = f"bench-{uuid.uuid4().hex[:10]}"
                    spec = child_spec(wf, settings, steps=steps)
                    if case.fault:
                        arm_fault(emu, case.fault)
                        try:
                            await server.run("", spec)
                        finally:
                            emu.faults.clear()
                    for point in case.crashes:
                        await server.run(point, spec)
                    before = {c["id"]: c["status"] for c in chats_of(emu, wf)}
                    start = time.perf_counter()
                    results = await agent_workflow(wf, steps, settings)
                    times.append(time.perf_counter() - start)
                    last = results[-1]
                    assert isinstance(last, TurnResult), last
                    main = last.chat_id
                    texts = user_texts(emu, main)
                    extra = sum(
                        max(0, sum(step_marker(wf, s.name) in t for t in texts) - 1) for s in steps
                    )
                    # the crashed turn is the one on the chat the workflow ends on
                    live = before.get(main) in live_statuses
                    if main not in before:
                        finished = "fresh chat"  # an orphan was swept, the step ran anew
                    elif extra:
                        finished = "resubmitted"
                    else:
                        finished = "followed" if live else "recovered"
                    how[finished] = how.get(finished, 0) + 1
                    totals[finished] += 1
                    live_total += int(live)
                print(
                    f"{case.name:58s} {statistics.median(times) * 1000:10.0f} "
                    f"{max(times) * 1000:8.0f}  "
                    + ", ".join(f"{k} {v}" for k, v in sorted(how.items()))
                )
        finally:
            await server.stop()
        share = totals["followed"] / live_total if live_total else 0.0
        print(
            f"\ncrashed turns: {sum(totals.values())}; still live when the rerun started: "
            f"{live_total}; finished by following: {totals['followed']} "
            f"({share:.0%} of the live ones); recovered from history: {totals['recovered']}; "
            f"resubmitted: {totals['resubmitted']}; on a fresh chat: {totals['fresh chat']}"
        )

        # The deliberate commit-horizon sleep, measured on its own.
        store = StateStore(f"sqlite+aiosqlite:///{tmp / 'horizon.db'}")
        async with ChatClient(emu.base_url, token, organization_id=emu.organization_id) as client:
            marker = f"[bench-h-{uuid.uuid4().hex[:6]}/s]"
            chat = await client.create_chat(
                CreateChatRequest(
                    organization_id=emu.organization_id,
                    content=[ChatInputPart.text_part(f'{marker} hi #emu {{"text": "ok"}}')],
                )
            )
            await emu.await_status(chat.id, "waiting")
            await store.journal.set(
                chat.id,
                JournalEntry(state="submitting", marker=marker, attempt=1, at=time.time()),
            )
            start = time.perf_counter()
            outcome = await TurnRecovery(
                client,
                store,
                chat.id,
                marker,
                timings=RecoveryTimings(poll_interval=0.05, commit_horizon=args.horizon),
            ).run()
            total = time.perf_counter() - start
        await store.aclose()
        print(
            f"\ncommit horizon {args.horizon:.1f} s on an unlanded resubmission: recovery "
            f"{total * 1000:.0f} ms, of which the deliberate sleep {outcome.horizon_slept_s * 1000:.0f}"
            f" ms ({outcome.classification}); production horizon = request timeout (300 s)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--horizon", type=float, default=2.0)
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--continuation", type=float, default=5.0)
    parser.add_argument("--only", default="", help="run only rows whose name contains this")
    parser.add_argument(
        "--deployed",
        action="store_true",
        help="kill -> recovered result through the deployed path (bench/recovery_deployed.py)",
    )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import recovery_deployed

    recovery_deployed.add_arguments(parser)
    parsed = parser.parse_args()
    if parsed.deployed:
        asyncio.run(recovery_deployed.run(parsed))
    else:
        asyncio.run(main(parsed))

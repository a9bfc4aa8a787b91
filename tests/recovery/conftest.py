"""Fixtures of the crash-recovery tests: a real Prefect test server, a real emulator,
a real SQLite store, and the test "payments" service.

Recovery time constants are shortened through the environment (the settle poll
and the commit horizon), so the whole suite stays fast: in this process for each
module of this directory only (``_fast_recovery_env``; under pytest-xdist other
directories' files run in the same process afterwards and must see the product's
values), and in every crash child's own environment (``recovery_env.PrefectEnv``).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from warm_python import WarmPython

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from crash_matrix import (  # noqa: E402
    STEPS,
    ForkServer,
    crash_settings,
    env_for_children,
    run_workflow,
)
from payments import Payments, running_payments  # noqa: E402
from recovery_env import FAST_ENV, TOKEN, PrefectEnv, api_ca_bundle  # noqa: E402

from coder_chat.emulator import Emulator  # noqa: E402
from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore  # noqa: E402
from prefect_coder.flows.common.params import WorkflowSettings  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _fast_recovery_env() -> Iterator[None]:
    """The fast constants for this module's in-process recoveries, restored after it.

    Module scope, autouse: set up before the module's own module-scoped fixtures
    (the crash matrix recovers in one), torn down before the next file runs."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in FAST_ENV.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module", autouse=True)
def _light_api_tls() -> Iterator[None]:
    """This module's Prefect API clients load a one-certificate CA bundle
    (``recovery_env.api_ca_bundle``: every flow run makes two or three clients, each
    ≈ 40 ms of CPU with certifi's), restored after it (the next file's are Prefect's
    default). The crash children do the same (``crash_child.py``)."""
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, temporary_settings

    with temporary_settings(updates={PREFECT_API_SSL_CERT_FILE: str(api_ca_bundle())}):
        yield


@pytest.fixture(scope="session")
def payments() -> Iterator[Payments]:
    with running_payments() as p:
        old = os.environ.get("PAYMENTS_URL")
        os.environ["PAYMENTS_URL"] = p.url
        try:
            yield p
        finally:
            if old is None:
                os.environ.pop("PAYMENTS_URL", None)
            else:
                os.environ["PAYMENTS_URL"] = old


#: The emulator's client-tool pause timeout here. chatd's 300 s is shorter than a
#: loaded machine can take between a case's crash and its recovery (the crash
#: matrix crashes every case before it recovers any: 377 s at load 15), and a pause
#: timed out by then turns the step's answer into "Tool execution timed out". The
#: tests about that timeout expire the pause explicitly (expire_requires_action).
PAUSE_TIMEOUT_S = 3600.0


@pytest.fixture(scope="session")
def emu() -> Iterator[Emulator]:
    with Emulator.running_in_thread(
        tokens=[TOKEN], delta_delay=0.0, requires_action_timeout=PAUSE_TIMEOUT_S
    ) as e:
        yield e


@pytest.fixture
def fresh_emu() -> Iterator[Emulator]:
    """An emulator of its own, for tests that arm faults or inspect every chat."""
    with Emulator.running_in_thread(
        tokens=[TOKEN], delta_delay=0.0, requires_action_timeout=PAUSE_TIMEOUT_S
    ) as e:
        yield e


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateStore]:
    """The same tests on both real backends (PostgreSQL: the session's private cluster)."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    s = StateStore(url, tenant=f"recovery-{uuid.uuid4().hex[:8]}")
    yield s
    await s.aclose()


@pytest.fixture(scope="session")
def prefect_env(prefect_harness: Any) -> PrefectEnv:
    return PrefectEnv(prefect_harness.api_url, prefect_harness.results_dir)


@pytest.fixture(scope="session")
async def coder_block(prefect_env: PrefectEnv, emu: Emulator) -> str:
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(emu.organization_id),
        token=SecretStr(TOKEN),
        request_timeout=5.0,
        turn_timeout=20.0,
    ).save("recovery-test-coder", overwrite=True)
    return "recovery-test-coder"


@pytest.fixture(scope="session")
async def sqlite_block(prefect_env: PrefectEnv, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("state") / "state.db"
    await ChatStateStore(url=f"sqlite+aiosqlite:///{path}", tenant="recovery").save(
        "recovery-test-sqlite", overwrite=True
    )
    return "recovery-test-sqlite"


@pytest.fixture
def workflow_id(request: pytest.FixtureRequest) -> str:
    name = "".join(c if c.isalnum() else "-" for c in request.node.name[:40]).strip("-")
    return f"r-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def settings(coder_block: str, sqlite_block: str, payments: Payments) -> WorkflowSettings:
    return crash_settings(coder_block, sqlite_block)


@pytest.fixture(scope="session")
def matrix_settings(settings: WorkflowSettings) -> WorkflowSettings:
    """The crash matrix's settings: the suite's, with a turn deadline no loaded
    machine reaches here.

    A second crash point inside recovery (``recovery.after_submit``) is reached only
    while the crashed attempt is within its turn deadline: past it, recovery cuts the
    attempt short instead of answering its pause, the child finishes, and the row
    fails for a reason that is not the one it checks. With eight children starting
    Prefect at once on a loaded 2-core machine the second child came later than the
    credentials' 20 s (twice at load 13-20). No row waits out this deadline.
    """
    return settings.model_copy(update={"turn_timeout_s": 120.0})


@pytest.fixture(scope="session")
async def fork_server(
    prefect_env: PrefectEnv,
    payments: Payments,
    warm_python: WarmPython,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ForkServer]:
    """Crash runs forked from the session's warm process (tests/warm_python.py:
    no Prefect import per child; each is still a process of its own, SIGKILLed)."""
    env = env_for_children(prefect_env.child_env(), payments.url)
    # Another import-time PREFECT_* setting in this process's environment by now (a
    # test elsewhere that left one set): a warm process of its own for these
    # children, rather than the import paid by every child.
    warm = warm_python if warm_python.would_fork(env) else None
    server = ForkServer(env, tmp_path_factory.mktemp("fork") / "children-stderr.log", warm)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="session")
async def baseline(prefect_env: PrefectEnv, settings: WorkflowSettings) -> list[str]:
    """The fault-free run's step texts of the crash-matrix workflow."""
    results = await run_workflow(f"r-baseline-{uuid.uuid4().hex[:8]}", STEPS, settings)
    return [r.text for r in results]

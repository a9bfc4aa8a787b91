"""Constants and the Prefect environment of the crash-recovery tests.

A module of its own (not the conftest): test files import it by a unique name, so
they never pick up another directory's ``conftest`` module by accident.
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

TOKEN = f"tok-recovery-{uuid.uuid4().hex}-SECRET"
#: Short recovery constants for tests (production: 1 s poll, horizon = request timeout).
FAST_ENV = {"PREFECT_CODER_SETTLE_POLL_S": "0.05", "PREFECT_CODER_COMMIT_HORIZON_S": "1.0"}
#: A child's ``PREFECT_API_SSL_CERT_FILE``, applied by the child at run time
#: (``crash_child.py``, the trigger test's runner): in the environment it would be
#: an import-time Prefect setting, and a fork must share those with its warm process.
CA_FILE_ENV = "RECOVERY_API_CA_FILE"


@functools.cache
def api_ca_bundle() -> Path:
    """A CA bundle of one certificate, for ``PREFECT_API_SSL_CERT_FILE``.

    Every Prefect API client builds a TLS context from its CA bundle when it is
    made, even for an ``http://`` API: certifi's ~150 certificates, ≈ 40 ms of CPU,
    and a flow run makes two or three clients (its own, the sync one that looks up
    the default result storage, the events worker's) — the largest single cost of
    an in-process recovery here (about half its CPU, py-spy) and a third of a crash
    child's. The test server is plain HTTP on loopback, so no certificate is ever
    checked: one (certifi's first) makes the context as valid and ~40x cheaper.
    Were the API ever HTTPS here, its connections would fail, not go unverified.
    Children also get it as ``SSL_CERT_FILE`` (``PrefectEnv.child_env``): httpx's
    default context, which the Coder client builds once per process. (The session
    sets one for every process too, ``tests/conftest.py``; this one also holds with
    ``PREFECT_CODER_TEST_SYSTEM_TRUST=1``.)"""
    # Here, not at the top: crash children import this module with tests/recovery,
    # not tests/, on their path.
    from support.trust import one_certificate_bundle

    return one_certificate_bundle("recovery-ca-")


@dataclass(frozen=True)
class PrefectEnv:
    api_url: str
    results_dir: Path

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(self.results_dir),
            PREFECT_LOGGING_LEVEL="WARNING",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH")) if p
            ),
            **FAST_ENV,
        )
        env[CA_FILE_ENV] = str(api_ca_bundle())
        # httpx's default TLS context (the Coder client's, read at call time): the
        # same one-certificate bundle — every service here is plain HTTP on loopback.
        env["SSL_CERT_FILE"] = str(api_ca_bundle())
        env.update(extra)
        return env

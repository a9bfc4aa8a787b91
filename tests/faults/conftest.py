"""Faults of our own dependencies (issue 30): a private PostgreSQL cluster per module
that a test may restart, a result storage of the test's own that a test may make
unwritable, the tool's own effect log, and the thread-hosted emulator."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from faults_pg import PrivateCluster, running_cluster  # noqa: E402
from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings  # noqa: E402
from unwritable import make_writable  # noqa: E402


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[PrivateCluster]:
    """A cluster of this module's own (never the session's shared one): restarted by
    the tests; each test gets it running (:meth:`PrivateCluster.start` if stopped)."""
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture
def private_pg(pg_cluster: PrivateCluster) -> PrivateCluster:
    if not pg_cluster.running:
        pg_cluster.start()
    return pg_cluster


@pytest.fixture
def results_dir(tmp_path: Path) -> Iterator[Path]:
    """This test's own result storage (the session's stays writable for the others);
    writable again when the test ends."""
    path = tmp_path / "results"
    path.mkdir()
    with temporary_settings(updates={PREFECT_RESULTS_LOCAL_STORAGE_PATH: path}):
        try:
            yield path
        finally:
            make_writable(path)

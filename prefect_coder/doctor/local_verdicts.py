"""Verdicts on this side of the product: the state store and the Prefect API with the
product's automation. Pure functions over ``observed.py``'s records."""

from __future__ import annotations

from .checks import Check, Status
from .observed import PrefectObserved, StoreObserved

__all__ = ["ZOMBIE_AUTOMATION", "automations", "prefect_api", "store"]

#: ``prefect_coder.flows.deployments.zombies.ZOMBIE_AUTOMATION``, spelled out: the
#: verdicts stay importable without Prefect (tests/doctor/test_verdicts.py keeps the
#: two equal).
ZOMBIE_AUTOMATION = "prefect-coder: crash runs whose heartbeats stopped"

_SHARED = (
    "save a ChatStateStore block with a postgresql+asyncpg:// URL (password in its "
    "`password` field) and point every deployment at it"
)


def store(obs: StoreObserved) -> Check:
    """Reachable, its schema version, shared (PostgreSQL) or local (SQLite)."""
    if obs.config_error is not None:
        return Check(
            "store",
            Status.FAIL,
            f"{obs.source}: {obs.config_error}",
            "fix the block (Prefect UI → Blocks) or save it again; see docs/state-store.md",
        )
    where = f"{obs.url} (tenant {obs.tenant!r})"
    if obs.connect_error is not None:
        return Check(
            "store",
            Status.FAIL,
            f"{obs.source} {where} cannot be read: {obs.connect_error}",
            "check the URL's host, port and database, the block's `password`, and that this "
            "machine can reach it"
            if obs.backend == "postgresql"
            else "check that the file's directory is readable by this user",
        )
    want = obs.expected_version
    if obs.version is not None and obs.version > want:
        return Check(
            "store",
            Status.FAIL,
            f"{where}: schema version {obs.version}, newer than this prefect-coder "
            f"understands ({want})",
            "upgrade prefect-coder on this machine to the version the workers run",
        )
    if not obs.exists or not obs.has_tables or obs.version is None:
        state = "no file yet" if not obs.exists else "no tables yet"
        schema = f"{state} (created by the first workflow, schema version {want})"
    elif obs.version < want:
        schema = (
            f"schema version {obs.version}: the first worker of this version upgrades it to "
            f"{want}, and workers still on the old version then refuse it (upgrade them "
            "together)"
        )
    else:
        schema = f"schema version {obs.version}"
    if obs.backend == "sqlite":
        return Check(
            "store",
            Status.WARN,
            f"local SQLite {where}, {schema}: fine for one machine; several workers need "
            "PostgreSQL",
            _SHARED,
        )
    status = Status.OK if obs.version in (None, want) else Status.WARN
    fix = "" if status is Status.OK else "upgrade every worker to this prefect-coder version"
    return Check("store", status, f"PostgreSQL {where}, shared by every worker; {schema}", fix)


def prefect_api(obs: PrefectObserved) -> Check:
    """The Prefect API the workers and deployments use."""
    if obs.api_url is None:
        return Check(
            "prefect-api",
            Status.WARN,
            "PREFECT_API_URL is not set: each process would start a temporary local server",
            "set PREFECT_API_URL to your Prefect server (`prefect config set "
            "PREFECT_API_URL=https://…/api`); workers and deployments need one",
        )
    if obs.error is not None:
        return Check(
            "prefect-api",
            Status.FAIL,
            f"{obs.api_url} does not answer: {obs.error}",
            "start the Prefect server or fix PREFECT_API_URL (and PREFECT_API_KEY for Prefect "
            "Cloud)",
        )
    return Check(
        "prefect-api", Status.OK, f"{obs.api_url} answers (server API {obs.server_version})"
    )


def automations(obs: PrefectObserved) -> Check | None:
    """The zombie-run automation ``prefect-coder automations apply`` creates."""
    if obs.api_url is None or obs.error is not None:
        return None
    name = obs.automation_name
    named = "" if name == ZOMBIE_AUTOMATION else f" --name {name!r}"
    apply = f"run `prefect-coder automations apply{named}` (after every `prefect deploy`)"
    if obs.automation_error is not None:
        return Check(
            "automations", Status.WARN, f"could not read {name!r}: {obs.automation_error}", apply
        )
    if not obs.automation_found:
        return Check(
            "automations",
            Status.WARN,
            f"{name!r} is not applied: a run on a lost host stays Running and is never recovered",
            apply,
        )
    if not obs.automation_enabled:
        return Check(
            "automations",
            Status.WARN,
            f"{name!r} is disabled",
            "enable it (Prefect UI → Automations), or " + apply,
        )
    if obs.flows_not_covered:
        return Check(
            "automations",
            Status.WARN,
            f"{name!r} does not cover {', '.join(obs.flows_not_covered)} (applied by an older "
            "prefect-coder)",
            apply,
        )
    return Check(
        "automations",
        Status.OK,
        f"{name!r} applied and enabled (workers need PREFECT_FLOWS_HEARTBEAT_FREQUENCY set)",
    )

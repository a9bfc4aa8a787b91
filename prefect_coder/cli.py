"""``prefect-coder``: operator commands for a deployment of prefect-coder.

``prefect-coder automations apply`` creates (or updates in place) the automation
that marks a flow run whose heartbeats stopped as Crashed — the only way a run
on a lost host reaches the ``recover-turn`` triggers. Run it after every
``prefect deploy``; it is idempotent. Until the console script is installed:
``python -m prefect_coder.cli automations apply``.

``prefect-coder doctor`` checks a real deployment before the first workflow: the Coder
server, token, organization, build, chat routes and stream, limits, the state store and
the Prefect API with that automation; one line per check, non-zero exit on any FAIL
(docs/doctor.md).
"""

from __future__ import annotations

import asyncio

import typer

from prefect_coder.flows.deployments.zombies import (
    DEFAULT_HEARTBEAT_S,
    MISSED_HEARTBEATS,
    ZOMBIE_AUTOMATION,
    apply_zombie_automation,
)

app = typer.Typer(help="Operator commands for prefect-coder.", no_args_is_help=True)
automations = typer.Typer(help="The Prefect automations prefect-coder needs.", no_args_is_help=True)
app.add_typer(automations, name="automations")


@automations.command("apply")
def apply(
    heartbeat_seconds: int = typer.Option(
        DEFAULT_HEARTBEAT_S,
        "--heartbeat-seconds",
        min=30,
        help="PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the workers (Prefect's minimum: 30).",
    ),
    missed: int = typer.Option(
        MISSED_HEARTBEATS,
        "--missed",
        min=1,
        help="Heartbeats a run may miss before it is marked Crashed.",
    ),
    name: str = typer.Option(ZOMBIE_AUTOMATION, "--name", help="The automation's name."),
) -> None:
    """Create or update the zombie-run automation (runs whose heartbeats stopped → Crashed)."""
    done = asyncio.run(
        apply_zombie_automation(
            heartbeat_s=heartbeat_seconds, within_s=float(missed * heartbeat_seconds), name=name
        )
    )
    typer.echo(
        f"{done.action}: automation {name!r} (id {done.automation.id}): a flow run of "
        f"prefect-coder's flows with no heartbeat for {missed * heartbeat_seconds}s is "
        f"marked Crashed. Workers must run with "
        f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY={heartbeat_seconds}."
    )


@app.command("doctor")
def doctor(
    credentials_block: str | None = typer.Option(
        None,
        "--credentials-block",
        help="A saved CoderCredentials block to check (else --base-url and the environment).",
    ),
    base_url: str | None = typer.Option(
        None, "--base-url", help="The Coder deployment's URL (default: $CODER_URL)."
    ),
    token_env: str = typer.Option(
        "CODER_SESSION_TOKEN",
        "--token-env",
        help="The environment variable that holds the session token. The token itself is "
        "never a flag: flags end up in shell history and process lists.",
    ),
    org_id: str | None = typer.Option(
        None, "--org-id", help="The organization's UUID (default: $CODER_ORG_ID)."
    ),
    insecure: bool = typer.Option(
        False, "--insecure", help="Do not verify the server's TLS certificate (test servers)."
    ),
    store_block: str | None = typer.Option(
        None,
        "--store-block",
        help="A saved ChatStateStore block to check (default: the default local store).",
    ),
    smoke: bool = typer.Option(
        False, "--smoke", help="Also run one tiny turn in a labelled doctor chat, then archive it."
    ),
    smoke_timeout: float = typer.Option(
        120.0, "--smoke-timeout", min=1.0, help="Seconds the smoke turn may take."
    ),
    automation_name: str = typer.Option(
        ZOMBIE_AUTOMATION,
        "--automation-name",
        help="The name `automations apply` was given (its --name).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check that prefect-coder will work against a Coder deployment (docs/doctor.md)."""
    from prefect_coder.doctor import DoctorOptions, diagnose

    options = DoctorOptions(
        credentials_block=credentials_block,
        base_url=base_url,
        token_env=token_env,
        organization_id=org_id,
        insecure=insecure,
        store_block=store_block,
        smoke=smoke,
        smoke_timeout=smoke_timeout,
        automation_name=automation_name,
    )
    found = asyncio.run(diagnose(options))
    typer.echo(found.json() if as_json else found.text())
    raise typer.Exit(found.exit_code)


def main() -> None:
    """The ``prefect-coder`` console script."""
    app()


if __name__ == "__main__":
    main()

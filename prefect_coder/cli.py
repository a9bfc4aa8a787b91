"""``prefect-coder``: operator commands for a deployment of prefect-coder.

``prefect-coder automations apply`` creates (or updates in place) the automation
that marks a flow run whose heartbeats stopped as Crashed — the only way a run
on a lost host reaches the ``recover-turn`` triggers. Run it after every
``prefect deploy``; it is idempotent. Until the console script is installed:
``python -m prefect_coder.cli automations apply``.
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


def main() -> None:
    """The ``prefect-coder`` console script."""
    app()


if __name__ == "__main__":
    main()

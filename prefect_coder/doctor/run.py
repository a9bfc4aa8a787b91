"""``diagnose()``: run every check in order and gather the report.

The order is the order of dependence: the settings, then the Coder deployment (server →
token → organization → models → build → chat routes and stream → limits → smoke), then
the state store, then the Prefect API and the product's automation. A Coder check that
an earlier failure makes pointless is not run (the failure above it says why); the
store and Prefect checks always run.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass

from . import coder_verdicts as cv
from . import local_verdicts as lv
from .checks import Check, Report, Status, report
from .observe_coder import observe_coder, observe_routes, observe_smoke
from .observe_local import PREFECT_TIMEOUT, observe_prefect, observe_store
from .target import DEFAULT_TOKEN_ENV, Target, from_credentials, from_flags

__all__ = ["DoctorOptions", "diagnose"]


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What to check (the ``prefect-coder doctor`` flags)."""

    credentials_block: str | None = None
    base_url: str | None = None
    token_env: str = DEFAULT_TOKEN_ENV
    organization_id: str | None = None
    insecure: bool = False
    store_block: str | None = None
    smoke: bool = False
    smoke_timeout: float = 120.0
    automation_name: str | None = None


async def _target(options: DoctorOptions, env: Mapping[str, str]) -> tuple[Target | None, Check]:
    name = options.credentials_block
    if not name:
        return from_flags(
            env,
            base_url=options.base_url,
            token_env=options.token_env,
            organization_id=options.organization_id,
            insecure=options.insecure,
        )
    from prefect_coder.blocks import CoderCredentials, InvalidCoderCredentialsError

    try:
        async with asyncio.timeout(PREFECT_TIMEOUT):
            creds = await CoderCredentials.aload(name)
    except InvalidCoderCredentialsError as exc:
        return None, Check("credentials", Status.FAIL, f"block {name!r}: {exc.problems}", str(exc))
    except ValueError:
        return None, Check(
            "credentials",
            Status.FAIL,
            f"no CoderCredentials block named {name!r}",
            "create it (Prefect UI → Blocks → Coder Credentials, or "
            f"CoderCredentials.from_env().save({name!r})); `prefect block ls` lists the saved ones",
        )
    except Exception as exc:  # the Prefect API itself: the prefect-api line says more
        text = str(exc) or f"no answer within {PREFECT_TIMEOUT:.0f} s"
        return None, Check(
            "credentials",
            Status.FAIL,
            f"could not load block {name!r}: {type(exc).__name__}: {text}",
            "check PREFECT_API_URL (see the prefect-api line below)",
        )
    target = from_credentials(name, creds)
    return target, Check(
        "credentials", Status.OK, f"{target.base_url} from {target.source} (token not shown)"
    )


async def _coder(target: Target, options: DoctorOptions) -> list[Check]:
    obs = await observe_coder(target)
    out: list[Check] = [cv.server(obs, target)]
    tok = cv.token(obs, target)
    if tok is not None:
        out.append(tok)
    if cv.coder_usable(out) and obs.me is not None:
        org = cv.organization(obs, target)
        # A wrong organization's model listing is a 404 that says nothing of the models.
        mdl = cv.models(obs) if org is None or org.status is not Status.FAIL else None
        bld, guess = cv.build(obs)
        out += [c for c in (org, mdl, bld) if c is not None]
        if cv.coder_usable(out) and guess is not None:
            run_id = uuid.uuid4().hex[:12]
            out += cv.routes(await observe_routes(target, guess, run_id), target)
            if options.smoke and cv.coder_usable(out):
                out.append(cv.smoke(await observe_smoke(target, run_id, options.smoke_timeout)))
    if options.smoke and not any(c.name == "smoke" for c in out):
        out.append(
            Check("smoke", Status.WARN, "not run: a Coder check above failed", "fix that first")
        )
    out.append(cv.limits(target))
    return out


async def diagnose(options: DoctorOptions, env: Mapping[str, str] | None = None) -> Report:
    """Every check, in order; the report is redacted of every secret it handled."""
    environ = os.environ if env is None else env
    checks: list[Check] = []
    secrets: list[str] = []
    target, settings = await _target(options, environ)
    checks.append(settings)
    if target is not None:
        secrets.append(target.token.get_secret_value())
        checks += await _guarded("coder", _coder(target, options))
    checks += await _guarded("store", _store(options, secrets))
    checks += await _guarded("prefect-api", _prefect(options))
    return report(checks).redacted(secrets)


async def _store(options: DoctorOptions, secrets: list[str]) -> list[Check]:
    obs, handled = await observe_store(options.store_block)
    secrets += handled
    return [lv.store(obs)]


async def _prefect(options: DoctorOptions) -> list[Check]:
    obs = await observe_prefect(options.automation_name)
    auto = lv.automations(obs)
    return [lv.prefect_api(obs), *([auto] if auto is not None else [])]


async def _guarded(area: str, checks: Awaitable[list[Check]]) -> list[Check]:
    """An area's checks; a bug of the doctor's own in one area becomes a FAIL line there
    and the other areas still run."""
    try:
        return await checks
    except Exception as exc:
        return [
            Check(
                area,
                Status.FAIL,
                f"the doctor itself failed here: {type(exc).__name__}: {exc}",
                "please report it with this line",
            )
        ]

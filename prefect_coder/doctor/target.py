"""What the doctor checks: the Coder deployment's settings, from a credentials block or
from flags and the environment, and where each one came from (so a fix can name it).

Pure: the environment is passed in. The token stays a ``SecretStr``; only the name of
the variable or block that holds it is ever shown.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pydantic import SecretStr

from .checks import Check, Status

if TYPE_CHECKING:
    from prefect_coder.blocks import CoderCredentials

__all__ = ["DEFAULT_TOKEN_ENV", "Fields", "Target", "from_credentials", "from_flags"]

DEFAULT_TOKEN_ENV = "CODER_SESSION_TOKEN"
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, slots=True)
class Fields:
    """How to name each setting in a fix: a block field or a flag/variable."""

    base_url: str
    token: str
    organization_id: str
    verify_tls: str
    max_concurrent_turns: str


@dataclass(frozen=True, slots=True)
class Target:
    """One Coder deployment to check. ``organization_id`` is None when it is missing;
    ``organization_raw`` keeps a value that is not a UUID (for the fix)."""

    source: str
    fields: Fields
    base_url: str
    token: SecretStr
    organization_id: str | None
    organization_raw: str | None = None
    verify_tls: bool = True
    http_timeout: float = 30.0
    request_timeout: float = 300.0
    max_concurrent_turns: int | None = None

    def __repr__(self) -> str:
        return f"Target(source={self.source!r}, base_url={self.base_url!r})"


def from_credentials(block_name: str, creds: CoderCredentials) -> Target:
    """The deployment a saved ``CoderCredentials`` block names (already validated)."""
    return Target(
        source=f"CoderCredentials block {block_name!r}",
        fields=Fields(
            base_url=f"the block's base_url ({block_name!r})",
            token=f"the block's token ({block_name!r})",
            organization_id=f"the block's organization_id ({block_name!r})",
            verify_tls=f"the block's verify_tls ({block_name!r})",
            max_concurrent_turns=f"the block's max_concurrent_turns ({block_name!r})",
        ),
        base_url=creds.base_url,
        token=creds.token,
        organization_id=str(creds.organization_id),
        verify_tls=creds.verify_tls,
        http_timeout=creds.http_timeout,
        request_timeout=creds.request_timeout,
        max_concurrent_turns=creds.max_concurrent_turns,
    )


def from_flags(
    env: Mapping[str, str],
    *,
    base_url: str | None = None,
    token_env: str = DEFAULT_TOKEN_ENV,
    organization_id: str | None = None,
    insecure: bool = False,
) -> tuple[Target | None, Check]:
    """The deployment named by flags, falling back to CODER_URL / the token variable /
    CODER_ORG_ID / CODER_VERIFY_TLS. Returns the target (None when it cannot be
    checked at all) and the ``credentials`` check that says so."""
    fields = Fields(
        base_url="--base-url (or CODER_URL)",
        token=f"${token_env}",
        organization_id="--org-id (or CODER_ORG_ID)",
        verify_tls="--insecure (or CODER_VERIFY_TLS)",
        max_concurrent_turns="max_concurrent_turns of your CoderCredentials block",
    )
    url = (base_url or env.get("CODER_URL") or "").strip()
    problems: list[tuple[str, str]] = []
    if not url:
        problems.append(
            (
                "base_url: not set",
                "pass --base-url https://coder.example.com, set CODER_URL, or use "
                "--credentials-block NAME",
            )
        )
    else:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(
                ("base_url: not an http(s) URL with a host", "give e.g. https://coder.example.com")
            )
        elif parts.username is not None or parts.password is not None:
            problems.append(
                ("base_url: contains user info", "remove it; the token travels in a header")
            )
        elif parts.query or parts.fragment:
            problems.append(
                ("base_url: has a query or fragment", "give only scheme, host and path")
            )
    raw_token = env.get(token_env, "")
    if not raw_token.strip():
        problems.append(
            (
                f"token: ${token_env} is not set or empty",
                f"export {token_env}=<a session token from `coder tokens create`>, or name "
                "another variable with --token-env",
            )
        )
    elif raw_token != raw_token.strip() or any(c in raw_token for c in "\r\n\t "):
        problems.append(
            (
                f"token: ${token_env} contains whitespace",
                "set the token without spaces or newlines",
            )
        )
    if problems:
        found = "; ".join(p for p, _ in problems)
        fix = "; ".join(f for _, f in problems)
        return None, Check("credentials", Status.FAIL, found, fix)
    org_text = (organization_id or env.get("CODER_ORG_ID") or "").strip()
    org: str | None = None
    org_raw: str | None = None
    if org_text:
        try:
            org = str(uuid.UUID(org_text))
        except ValueError:
            org_raw = org_text
    verify = not insecure and env.get("CODER_VERIFY_TLS", "true").strip().lower() not in _FALSE
    target = Target(
        source=f"{'--base-url' if base_url else 'CODER_URL'} and ${token_env}",
        fields=fields,
        base_url=url.rstrip("/"),
        token=SecretStr(raw_token),
        organization_id=org,
        organization_raw=org_raw,
        verify_tls=verify,
    )
    return target, Check(
        "credentials", Status.OK, f"{target.base_url} from {target.source} (token not shown)"
    )

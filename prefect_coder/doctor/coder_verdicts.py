"""Verdicts on a Coder deployment: server and TLS, token, organization, models, build,
limits, the chat routes and stream, and the smoke turn.

Pure functions over what the observers recorded (``observed.py``); each returns the
check(s) of one line of the report, or None when an earlier failure made it moot.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from .build import BUILDS, BuildGuess, infer_build
from .checks import Check, Status
from .observed import Answer, CoderObserved, Failure, RoutesObserved, SmokeObserved
from .target import Target

__all__ = [
    "DEFAULT_CAPACITY",
    "build",
    "coder_usable",
    "limits",
    "models",
    "organization",
    "routes",
    "server",
    "smoke",
    "token",
]

#: chatd's default capacity: concurrent root chats per deployment (chatd-wire §5).
DEFAULT_CAPACITY = 5
_UPGRADE = (
    "upgrade Coder to a release whose chat API is build B1 (004053e8) or later, with "
    "Coder Agents enabled"
)
_GATEWAY = "AI Gateway must be enabled"
#: The product archives every workflow's chat the same way (``stop_chat(archive=True)``).
_ARCHIVE_FIX = (
    "workflows archive their chats the same way (interrupt, then PATCH archived), so "
    "their chats would stay live too: check the error and coderd's logs"
)


def _server_error(answer: Answer, name: str) -> Check:
    """A 5xx: the deployment (or a proxy in front of it) is failing."""
    fix = "the Coder server (or a proxy in front of it) is failing: check coderd's logs and retry"
    if _GATEWAY in answer.message:
        fix = "enable the AI Gateway (Coder Agents) on the deployment, then retry"
    return Check(name, Status.FAIL, f"server error: {answer.describe()}", fix)


def _no_answer(answer: Answer, name: str, target: Target) -> Check:
    url = target.base_url
    host = urlsplit(url).hostname or url
    fixes = {
        Failure.REFUSED: (
            f"nothing listens at {url}: check {target.fields.base_url} (scheme, host, port) "
            "and that Coder is running and reachable from this machine"
        ),
        Failure.DNS: (
            f"the host name {host!r} does not resolve here: check {target.fields.base_url} "
            "and this machine's DNS"
        ),
        Failure.TLS: (
            "the server's certificate is not trusted here: give this machine the CA that "
            "signed it (SSL_CERT_FILE=/path/to/ca.pem), or, for a test server only, turn "
            f"verification off with {target.fields.verify_tls}"
        ),
        Failure.TIMEOUT: (
            f"no answer in time: check the network path (proxy, firewall) to {host}; raise "
            "http_timeout if the server is just slow"
        ),
    }
    failure = answer.failure or Failure.NETWORK
    fix = fixes.get(failure, f"check {target.fields.base_url} and the network path to {host}")
    what = "certificate not trusted" if failure is Failure.TLS else "unreachable"
    return Check(name, Status.FAIL, f"{url} {what}: {answer.describe()}", fix)


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server(obs: CoderObserved, target: Target) -> Check:
    """Reachability and TLS of ``base_url`` (``GET /api/v2/buildinfo``, sent without
    the token)."""
    a = obs.server
    if a.status is None:
        return _no_answer(a, "server", target)
    if a.server_error:
        return _server_error(a, "server")
    version = a.body.get("version") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(version, str):
        return Check(
            "server",
            Status.WARN,
            f"{obs.base_url} answers, but not like Coder: {a.describe()}",
            f"is {target.fields.base_url} the deployment's root URL (not a dashboard path "
            "or a proxy's login page)?",
        )
    https = obs.base_url.startswith("https://")
    found = f"{obs.base_url} answers: Coder {version}"
    if https and not obs.verify_tls:
        return Check(
            "server",
            Status.WARN,
            f"{found}; TLS certificate NOT verified",
            f"trust the server's CA and turn verification back on ({target.fields.verify_tls}); "
            "keep it off only for test servers",
        )
    if not https and not _loopback(obs.base_url):
        return Check(
            "server",
            Status.WARN,
            f"{found} over plain http: the session token crosses the network unencrypted",
            f"use the deployment's https:// URL in {target.fields.base_url}",
        )
    return Check("server", Status.OK, found + ("; TLS certificate verified" if https else ""))


def token(obs: CoderObserved, target: Target) -> Check | None:
    """The session token (``GET /api/v2/users/me``). Never shows any part of it."""
    a = obs.me
    if a is None:
        return None
    if a.status is None:
        return _no_answer(a, "token", target)
    if a.server_error:
        return _server_error(a, "token")
    if a.status in (401, 403):
        return Check(
            "token",
            Status.FAIL,
            f"rejected: {a.describe()}",
            "the session token is invalid, expired or lacks access: create one with "
            f"`coder tokens create` and store it in {target.fields.token}",
        )
    if a.ok and isinstance(a.body, dict):
        return Check("token", Status.OK, f"accepted: signed in as {a.body.get('username')}")
    return Check(
        "token",
        Status.WARN,
        f"could not tell: {a.describe()}",
        "the chat checks below still use the token",
    )


def _organization_ids(me: Answer | None) -> list[str] | None:
    if me is None or not me.ok or not isinstance(me.body, dict):
        return None
    ids = me.body.get("organization_ids")
    return [str(i) for i in ids] if isinstance(ids, list) else None


def organization(obs: CoderObserved, target: Target) -> Check | None:
    """The organization chats are created in: set, a UUID, one of the user's."""
    field = target.fields.organization_id
    if obs.organization_invalid:
        return Check(
            "organization",
            Status.FAIL,
            f"organization_id: {target.organization_raw!r} is not a UUID",
            f"set {field} to the organization's UUID (see `coder organizations show`)",
        )
    if obs.organization_id is None:
        return Check(
            "organization",
            Status.FAIL,
            "organization_id: not set (chats cannot be created without it)",
            f"set {field} to the organization's UUID (see `coder organizations show`)",
        )
    mine = _organization_ids(obs.me)
    user = obs.me.body.get("username") if obs.me and isinstance(obs.me.body, dict) else None
    if mine is not None and obs.organization_id not in mine:
        return Check(
            "organization",
            Status.FAIL,
            f"organization_id: {obs.organization_id} is not one of the organizations of "
            f"user {user} ({', '.join(mine) or 'none'})",
            f"set {field} to one of them",
        )
    m = obs.models
    if m is not None and m.status in (403, 404) and mine is None:
        return Check(
            "organization",
            Status.FAIL,
            f"organization_id: {obs.organization_id} not accessible: {m.describe()}",
            f"set {field} to an organization this user belongs to",
        )
    if mine is None:
        return Check(
            "organization",
            Status.WARN,
            f"organization_id {obs.organization_id}: membership not readable from users/me",
            "the chat-routes check below creates a chat in it",
        )
    return Check("organization", Status.OK, f"{obs.organization_id}: user {user} is a member")


def models(obs: CoderObserved) -> Check | None:
    """A chat model is available in the organization (else every POST /chats is 400)."""
    m = obs.models
    if m is None:
        return None
    if m.status is None or m.server_error:
        return Check("models", Status.WARN, f"could not list chat models: {m.describe()}", "")
    if m.status == 404 and obs.organization_id is not None and _organization_ids(obs.me):
        return Check(
            "models",
            Status.WARN,
            f"model listing not served: {m.describe()}",
            "model availability is unknown; the chat-routes check below will show it",
        )
    if not m.ok:
        return None  # reported by the organization check
    body: dict[str, Any] = m.body if isinstance(m.body, dict) else {}
    listed = body.get("models") or []
    if not listed:
        return Check(
            "models",
            Status.FAIL,
            "no chat model is available in this organization (POST /chats would answer 400)",
            "add a model provider and a model in Coder's AI settings for this organization",
        )
    default = next((x for x in listed if isinstance(x, dict) and x.get("is_default")), None)
    name = default.get("display_name") or default.get("model") if default else None
    return Check(
        "models",
        Status.OK,
        f"{len(listed)} chat model(s) available" + (f" (default: {name})" if name else ""),
    )


def build(obs: CoderObserved) -> tuple[Check | None, BuildGuess | None]:
    """Which server build answers, from the listing probes (``build.py``)."""
    answers = (obs.v2_list, obs.experimental_list, obs.status_query)
    if any(a is None for a in answers):
        return None, None
    v2, exp, sq = answers
    assert v2 is not None and exp is not None and sq is not None
    for a in answers:
        assert a is not None
        if a.status is None:
            return Check("build", Status.FAIL, f"listing failed: {a.describe()}", ""), None
        if a.server_error:
            return _server_error(a, "build"), None
        if a.status in (401, 403):
            return None, None  # the token check says why
    guess = infer_build(v2, exp, sq)
    if guess.build is not None:
        _, why = BUILDS[guess.build]
        return Check("build", Status.OK, f"{guess.label}: {why}"), guess
    if guess.problem == "no-chat-api":
        return (
            Check(
                "build",
                Status.FAIL,
                f"no chat API: {v2.describe()}; {exp.describe()}",
                _UPGRADE,
            ),
            guess,
        )
    if guess.problem == "experimental-only":
        return (
            Check(
                "build",
                Status.FAIL,
                f"an older build than B1: chats only on /api/experimental ({v2.describe()})",
                _UPGRADE,
            ),
            guess,
        )
    return (
        Check(
            "build",
            Status.WARN,
            f"unrecognised build: {v2.describe()}; {exp.describe()}; {sq.describe()}",
            "the client may still work (it adapts to what the server answers); see "
            "docs/client.md, 'Supported Coder builds'",
        ),
        guess,
    )


def coder_usable(checks: Sequence[Check | None]) -> bool:
    """Whether the chat-routes check can run: nothing above it failed."""
    return all(c is None or c.status is not Status.FAIL for c in checks)


def limits(target: Target) -> Check:
    """Quota and limits: chatd's capacity and queue cap are not readable over its API,
    so the product's own cap is compared with chatd's defaults."""
    cap = target.max_concurrent_turns
    unknown = (
        f"chatd's capacity is not readable over the API (default {DEFAULT_CAPACITY} "
        "concurrent root chats; 20 queued messages per chat)"
    )
    if cap is None:
        return Check(
            "limits",
            Status.WARN,
            f"{unknown}; no fleet cap set: turns beyond the capacity wait "
            "queued_for_capacity and count against their timeouts",
            f"set {target.fields.max_concurrent_turns} to at most your deployment's capacity "
            f"({DEFAULT_CAPACITY} unless it was raised)",
        )
    if cap > DEFAULT_CAPACITY:
        return Check(
            "limits",
            Status.WARN,
            f"{unknown}; fleet cap {cap} turns is above the default",
            f"fine if your deployment's capacity was raised to ≥ {cap}; else lower "
            f"{target.fields.max_concurrent_turns} to {DEFAULT_CAPACITY}",
        )
    return Check(
        "limits",
        Status.OK,
        f"fleet cap {cap} turn(s), within chatd's default capacity of {DEFAULT_CAPACITY} "
        "(the deployment's own value is not readable over the API)",
    )


def _route_failure(name: str, what: str, a: Answer, target: Target) -> Check:
    if a.status is None:
        return _no_answer(a, name, target)
    if a.server_error:
        return _server_error(a, name)
    if a.status == 404:
        return Check(name, Status.FAIL, f"{what} route missing: {a.describe()}", _UPGRADE)
    if a.status == 403 and "organization" in a.message:
        return Check(
            name,
            Status.FAIL,
            f"{what} refused: {a.describe()}",
            f"set {target.fields.organization_id} to an organization this user belongs to",
        )
    if a.status == 400 and "model" in a.message.lower():
        return Check(
            name,
            Status.FAIL,
            f"{what} refused: {a.describe()}",
            "add a model provider and a model in Coder's AI settings for this organization",
        )
    return Check(name, Status.FAIL, f"{what} refused: {a.describe()}", "")


def routes(obs: RoutesObserved, target: Target) -> list[Check]:
    """create → list → stream dial → archive of one labelled doctor chat."""
    c = obs.create
    if not c.ok or obs.chat_id is None:
        return [_route_failure("chat-routes", "create (POST /chats)", c, target)]
    out: list[Check] = []
    how = (
        "created empty: no model call"
        if obs.created_empty
        else "its first message's run, if still going, stopped by the archive"
    )
    lst = obs.listing
    if lst is None or not lst.ok:
        assert lst is not None
        out.append(_route_failure("chat-routes", "list (GET /chats)", lst, target))
    elif not obs.listed:
        out.append(
            Check(
                "chat-routes",
                Status.FAIL,
                f"created chat {obs.chat_id}, but GET /chats filtered by its label does not "
                "list it",
                "the sweeps find the product's chats by label: this Coder build does not "
                f"filter by label; {_UPGRADE}",
            )
        )
    else:
        out.append(
            Check(
                "chat-routes",
                Status.OK,
                f"{c.describe()} (doctor chat {obs.chat_id}, {how}); "
                f"{lst.method} {lst.path} lists it",
            )
        )
    s = obs.stream
    if s is not None:
        if s.ok:
            out.append(
                Check(
                    "stream",
                    Status.OK,
                    f"WebSocket {s.path}: 101, first event {obs.first_event!r} after "
                    f"{s.elapsed_ms:.0f} ms",
                )
            )
        elif s.status == 404:
            out.append(
                Check(
                    "stream",
                    Status.FAIL,
                    f"stream route missing: {s.describe()}",
                    f"{_UPGRADE}; if a proxy sits in front of Coder, let it pass WebSocket "
                    "upgrades on the chat routes",
                )
            )
        else:
            fix = (
                "let WebSocket upgrades (Upgrade/Connection headers) through every proxy or "
                "load balancer in front of Coder"
            )
            if s.status is None and s.failure is Failure.TLS:
                fix = _no_answer(s, "stream", target).fix
            out.append(Check("stream", Status.FAIL, f"stream dial failed: {s.describe()}", fix))
    if not obs.archived:
        out.append(
            Check(
                "cleanup",
                Status.FAIL,
                f"doctor chat {obs.chat_id} could not be archived "
                f"({obs.cleanup_error or 'unknown'})",
                f"{_ARCHIVE_FIX}; archive it in the Coder UI (label prefect-coder/doctor)",
            )
        )
    return out


_SMOKE_FIXES = {
    "timeout": (
        "the turn did not finish in time: the deployment may be at capacity "
        "(queued_for_capacity) or the model slow; retry, or raise --smoke-timeout"
    ),
    "auth": "the model provider rejected its key: check the provider's key in Coder's AI settings",
    "missing_key": "the model provider has no key: add one in Coder's AI settings",
    "provider_disabled": "the model provider is disabled in Coder's AI settings",
    "usage_limit": "a usage limit was reached: check the user's or organization's AI budget",
    "config": "the chat's model configuration is invalid: check Coder's AI settings",
}


def smoke(obs: SmokeObserved) -> Check:
    """One tiny turn: its reply and latency, and that its chat was archived."""
    where = f"doctor chat {obs.chat_id}" if obs.chat_id else "no chat created"
    if obs.error is not None:
        fix = _SMOKE_FIXES.get(
            obs.error_kind or "", "see the error; the chat checks above show the route"
        )
        found = f"turn failed ({where}): {obs.error}"
        if obs.chat_id and not obs.archived:
            found += f"; chat NOT archived ({obs.cleanup_error or 'unknown'}): archive it in the UI"
        return Check("smoke", Status.FAIL, found, fix)
    reply = " ".join((obs.reply or "").split())
    if len(reply) > 60:
        reply = reply[:57] + "..."
    found = f"reply {reply!r} in {obs.latency_s or 0:.2f} s ({where})"
    if not obs.archived:
        return Check(
            "smoke",
            Status.FAIL,
            f"{found}, but the chat could not be archived ({obs.cleanup_error or 'unknown'})",
            f"{_ARCHIVE_FIX}; archive it in the Coder UI (label prefect-coder/doctor)",
        )
    return Check("smoke", Status.OK, f"{found}, archived")

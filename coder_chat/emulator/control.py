"""Control API: ``/__emulator__/…`` JSON routes guarded by ``X-Emulator-Admin-Token``.

Mirrors the in-process handle (faults, scripts, introspection, restart) for clients in
other processes or languages. The prefix cannot collide with any Coder route.

This module and ``server.py`` are one idea: the control API *is* the ``Emulator``
handle, spoken over HTTP (every route calls the handle method of the same name). The
handle serves these routes, and the routes need the whole handle, so the type-only
import of ``Emulator`` below stays; a Protocol would only copy the handle's signature.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from .httpserver import Request, Response, error_response, json_response
from .script import Script
from .statemachine import Refused

if TYPE_CHECKING:
    from .server import Emulator

PREFIX = "/__emulator__"


async def handle_control(emu: Emulator, req: Request) -> Response:
    """Dispatch one control request (runs on the server loop)."""
    token = req.header("x-emulator-admin-token") or ""
    if not hmac.compare_digest(token.encode(), emu.admin_token.encode()):
        return error_response(401, "Missing or invalid X-Emulator-Admin-Token.")
    try:
        return await _route(emu, req)
    except Refused as e:
        return error_response(e.status, e.message, e.detail)
    except (ValueError, KeyError, TypeError) as e:
        return error_response(400, "Bad control request.", str(e))


def _body(req: Request) -> dict[str, Any]:
    data = req.json() if req.body else {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    return data


async def _route(emu: Emulator, req: Request) -> Response:
    segs = [s for s in req.path[len(PREFIX) :].split("/") if s]
    m = req.method
    core = emu._core
    assert core is not None
    f = emu.faults
    if segs == ["info"] and m == "GET":
        return json_response(
            200,
            {
                "base_url": emu.base_url,
                "organization_id": emu.organization_id,
                "users": [
                    {"id": u.id, "username": u.username, "token": u.token} for u in core.users
                ],
                "era": core.cfg.era.name,
                "config": {
                    **{k: v for k, v in core.cfg.__dict__.items() if k not in ("clock", "era")},
                    "era": core.cfg.era.name,
                },
            },
        )
    if segs == ["chats"] and m == "GET":
        return json_response(200, emu.chats())
    if segs == ["events"] and m == "GET":
        since = int((req.query.get("since") or ["0"])[-1])
        kinds = req.query.get("kind")
        log = emu.event_log(kinds=kinds)
        return json_response(200, log[since:])
    if segs == ["users"] and m == "POST":
        b = _body(req)
        u = emu.add_user(b["token"], b.get("username"))
        return json_response(201, u)
    if len(segs) >= 2 and segs[0] == "chats":
        cid = segs[1]
        rest = segs[2:]
        if not rest and m == "GET":
            return json_response(200, emu.chat(cid))
        if rest == ["messages"] and m == "GET":
            inc = (req.query.get("include_system") or ["true"])[-1] != "false"
            return json_response(200, emu.messages(cid, include_system=inc))
        if rest == ["script"] and m == "POST":
            b = _body(req)
            scope = b.get("scope", "next_turn")
            script = None if b.get("script") is None else Script.from_json(b["script"])
            if scope == "next_turn":
                if script is None:
                    raise ValueError("script is required for scope next_turn")
                emu.script_next_turn(cid, script)
            elif scope == "chat":
                emu.set_chat_script(cid, script)
            else:
                raise ValueError("scope must be next_turn or chat")
            return json_response(200, {"ok": True})
        if rest == ["expire-requires-action"] and m == "POST":
            return json_response(200, {"expired": emu.expire_requires_action(cid)})
        if rest == ["end-sleeps"] and m == "POST":
            return json_response(200, {"ended": emu.end_sleeps(cid)})
        if rest == ["share"] and m == "POST":
            b = _body(req)
            emu.share_chat(cid, b["username"])
            return json_response(200, {"ok": True})
    if segs == ["script", "default"] and m == "POST":
        b = _body(req)
        emu.set_default_script(None if b.get("script") is None else Script.from_json(b["script"]))
        return json_response(200, {"ok": True})
    if segs == ["faults"] and m == "GET":
        return json_response(200, core.faults.describe())
    if len(segs) == 2 and segs[0] == "faults" and m == "POST":
        b = _body(req)
        name = segs[1]
        if name == "clear":
            f.clear()
            return json_response(200, {"ok": True})
        if name == "drop-stream":
            n = f.drop_stream(
                b.get("chat_id"), after_frames=int(b.get("after_frames", 0)), code=b.get("code")
            )
            return json_response(200, {"affected": n})
        if name == "drop-next-stream":
            f.drop_next_stream(
                b.get("chat_id"),
                after_frames=int(b.get("after_frames", 0)),
                count=int(b.get("count", 1)),
                code=b.get("code"),
            )
            return json_response(200, {"ok": True})
        if name == "refuse-upgrades":
            f.refuse_upgrades(
                int(b.get("status", 503)),
                seconds=b.get("seconds"),
                count=b.get("count"),
                chat_id=b.get("chat_id"),
            )
            return json_response(200, {"ok": True})
        if name == "remove-route":
            f.remove_route(str(b["path"]), method=b.get("method"))
            return json_response(200, {"ok": True})
        if name == "stall-stream":
            f.stall_stream(b.get("chat_id"), seconds=b.get("seconds"))
            return json_response(200, {"ok": True})
        if name == "fail-rest":
            f.fail_rest(
                int(b.get("count", 1)),
                status=int(b.get("status", 503)),
                method=b.get("method"),
                path=b.get("path"),
                message=b.get("message"),
            )
            return json_response(200, {"ok": True})
        if name == "drop-response":
            f.drop_response(
                int(b.get("count", 1)), method=b.get("method", "POST"), path=b.get("path")
            )
            return json_response(200, {"ok": True})
        if name == "delay-commit":
            f.delay_commit(
                float(b["seconds"]),
                count=int(b.get("count", 1)),
                method=b.get("method", "POST"),
                path=b.get("path"),
            )
            return json_response(200, {"ok": True})
        if name == "hold-commit":
            f.hold_commit(
                until_path=b.get("until_path"),
                until_method=b.get("until_method", "GET"),
                until_count=int(b.get("until_count", 1)),
                count=int(b.get("count", 1)),
                method=b.get("method", "POST"),
                path=b.get("path"),
                max_seconds=float(b.get("max_seconds", 60.0)),
            )
            return json_response(200, {"ok": True})
    if segs == ["restart"] and m == "POST":
        b = _body(req)
        downtime = float(b.get("downtime", 0.0))
        loop = asyncio.get_running_loop()
        # Answer first; the restart aborts this very connection.
        loop.call_later(0.02, lambda: loop.create_task(emu.arestart(downtime)))
        return json_response(202, {"restarting": True, "downtime": downtime})
    return error_response(404, "Unknown control route.")

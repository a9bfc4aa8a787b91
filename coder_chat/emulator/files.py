"""Chat files: upload (raw body, type allowlist checked against the bytes) and download."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .httpserver import Request, Response, json_response
from .statemachine import Refused
from .store import FileRec, new_uuid
from .validation import NOT_FOUND, is_uuid, parse_uuid

if TYPE_CHECKING:
    from .core import Core
    from .store import User

FILE_CAP = 10 * 1024 * 1024
FILE_TYPES = {
    "application/json",
    "application/pdf",
    "image/gif",
    "image/jpeg",
    "image/png",
    "image/webp",
    "text/csv",
    "text/markdown",
    "text/plain",
}


def upload(core: Core, req: Request, user: User) -> Response:
    """POST /chats/files?organization=: store a raw body after the type and size checks."""
    org = req.param("organization")
    if not org or not is_uuid(org):
        raise Refused(400, "Missing or invalid organization query parameter.")
    if str(org) != core.organization_id:
        raise Refused(403, "You are not a member of the specified organization.")
    if req.too_large or len(req.body) > FILE_CAP:
        raise Refused(413, "File too large.", "Maximum file size is 10 MiB.")
    mt = (req.header("content-type") or "").split(";")[0].strip().lower()
    if mt not in FILE_TYPES or not _sniff_ok(mt, req.body):
        raise Refused(400, "Unsupported file type.", f"{mt or 'unknown'} is not allowed.")
    name = ""
    cd = req.header("content-disposition") or ""
    if "filename=" in cd:
        name = cd.split("filename=", 1)[1].strip().strip('"')
    f = FileRec(new_uuid(), user.id, core.organization_id, mt, name, req.body, core.now())
    core.files[f.id] = f
    core.log("file", None, id=f.id, size=len(req.body))
    return json_response(201, {"id": f.id})


def download(core: Core, user: User, raw: str) -> Response:
    """GET /chats/files/{file}: the stored bytes with their media type (owner only)."""
    fid = parse_uuid(raw)
    f = core.files.get(fid)
    if f is None or f.owner_id != user.id:
        raise Refused(404, NOT_FOUND)
    return Response(200, f.data, f.media_type)


def file_part(core: Core, user: User, file_id: str) -> dict[str, Any] | None:
    """The stored ``file`` message part for an input part's ``file_id`` (owner only)."""
    f = core.files.get(str(file_id))
    if f is None or f.owner_id != user.id:
        return None
    out: dict[str, Any] = {"file_id": f.id, "media_type": f.media_type}
    if f.name:
        out["name"] = f.name
    return out


_MAGIC = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "application/pdf": (b"%PDF-",),
}


def _sniff_ok(mt: str, data: bytes) -> bool:
    """The declared type must agree with the bytes (header and sniffed type both checked)."""
    if mt in _MAGIC:
        return any(data.startswith(m) for m in _MAGIC[mt])
    if mt == "image/webp":
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    if b"\x00" in data[:8192]:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True

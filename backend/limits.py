"""Request body size limit (uploads): refuse early, before the body is spooled to disk.

A declared ``Content-Length`` over the limit is answered 413 without reading the body; a
chunked body is counted as it streams and the request fails with 413 once it passes the limit.
"""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_message(limit_bytes: int, got: int | None = None) -> str:
    size = f"is {got / 1e6:.1f} MB; " if got is not None else "exceeds the limit; "
    return f"request body {size}the server accepts at most {limit_bytes / 1e6:g} MB (MOELAB_MAX_UPLOAD_MB): split the file or raise the limit"


class BodySizeLimit:
    def __init__(self, app: ASGIApp, limit_bytes: int) -> None:
        self.app = app
        self.limit = limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(send, int(declared))
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # FastAPI re-raises HTTPException from body parsing: the client gets a 413.
                    raise HTTPException(status_code=413, detail=too_large_message(self.limit))
            return message

        await self.app(scope, counting_receive, send)

    async def _reject(self, send: Send, size: int) -> None:
        await send_error(send, 413, too_large_message(self.limit, size))


async def send_error(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON error sent straight from a middleware, before the request body is read (the
    connection is closed after it: the unread body must not be taken for the next request)."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class StorableUrl:
    """A URL whose path or query holds a NUL (``%00``) is refused 422 before any route reads it: such a
    value could reach the SQL store (PostgreSQL refuses NUL in text) or a file name. Bodies are checked by
    the request models (``backend.schemas.common._In``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            query: bytes = scope.get("query_string") or b""
            if "\x00" in scope.get("path", "") or b"%00" in query or b"\x00" in query:
                where = "path" if "\x00" in scope.get("path", "") else "query"
                await send_error(send, 422, f"{where}: the URL holds a NUL character (%00); remove it from the request")
                return
        await self.app(scope, receive, send)

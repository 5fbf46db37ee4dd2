"""A request-body size limit, before any byte of an oversized body is parsed.

Without one, a 20 MB body was read, parsed and validated on the event-loop thread for 24 s
while /health waited behind it. An HTTP request whose Content-Length is over the limit gets
a 413 JSON error without being parsed; a body sent without one (chunked) is counted as it
arrives and refused as soon as it passes the limit. Either is read to its end and dropped
first (up to DRAIN_MAX_BYTES; reading is fast, parsing was the slow part), so that a client
still sending it reads the answer instead of a reset connection.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from kiln.server.errors import error_body

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 128k-token prompt as token ids is ~1 MB of JSON
DRAIN_MAX_BYTES = 64 << 20  # past this the connection is closed on the sender


class RequestTooLarge(HTTPException):
    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes; send less, or raise the limit "
                              f"(kiln serve --max-request-bytes)")


class BodyLimit:
    """ASGI middleware: bodies of at most `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= DRAIN_MAX_BYTES:
                await _drain(receive, DRAIN_MAX_BYTES)
            return await _refuse(send, RequestTooLarge(self.max_bytes))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_MAX_BYTES - seen)
                    # FastAPI passes an HTTPException raised while it reads the body to the
                    # app's handler for it (the same JSON error body as every other error).
                    raise RequestTooLarge(self.max_bytes)
            return message

        return await self.app(scope, counted, send)


async def _drain(receive, max_bytes: int) -> None:
    """Read and drop the rest of a body, at most max_bytes of it."""
    while max_bytes > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        max_bytes -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send, error: RequestTooLarge) -> None:
    body = json.dumps(error_body(error.status_code, error.detail, code=error.code)).encode()
    await send({"type": "http.response.start", "status": error.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})

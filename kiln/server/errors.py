"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} for every failure.

Handlers turn FastAPI's validation errors (bad JSON, wrong types, missing fields) and
Starlette's HTTP errors (unknown route, wrong method) into the same body, so a client
always learns which field was wrong.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def field_path(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'.

    Pydantic adds the member type to the location of a union's errors ('str',
    'list[int]', 'TextPart'); the path ends before it.
    """
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_NAMES:
            path += f".{part}" if path else part
        else:
            break
    return path or None


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and not content_type.split(";")[0].strip().lower().endswith("json"):
        return APIError(400, f"send the body as JSON with Content-Type: application/json (got "
                             f"{content_type or 'no Content-Type'!r})", code="invalid_content_type").response()
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return APIError(400, message, code="invalid_json").response()
    param = field_path(tuple(first["loc"]))
    reason = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    if param is None:
        message = f"the request body must be a JSON object: {reason}"
    else:
        message = f"{param}: {reason}"
        if first["type"] != "missing":
            message += f" (got {first['input']!r:.100})"
    return APIError(400, message, param=param, code=first["type"]).response()


# What FastAPI raises when a JSON body cannot even be decoded (e.g. bytes that are not UTF-8).
_UNREADABLE_BODY = "There was an error parsing the body"


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.detail == _UNREADABLE_BODY:
        return APIError(400, "the request body could not be read as JSON: it must be UTF-8 encoded JSON",
                        code="invalid_json").response()
    return JSONResponse(error_body(exc.status_code, str(exc.detail), code=getattr(exc, "code", None)),
                        status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback after this answer is sent.
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

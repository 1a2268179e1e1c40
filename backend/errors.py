"""Errors as answers: every failure is JSON ``{"detail": "<what was wrong and what to do>"}``.

Bad input is a 4xx with a message a person can act on, never a 500; validation errors are
flattened into one readable ``detail`` line (the per-field list stays in ``errors``).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moelab.store.artifacts import InsufficientStorage, is_disk_full
from moelab.engine.atomic import free_bytes, human_bytes

log = logging.getLogger("moelab.api")


class ApiError(Exception):
    """Raise from a route: ``status`` and a message saying what to fix."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers


def not_found(what: str, ident: str, listing: str) -> ApiError:
    return ApiError(404, f"no {what} with id {ident!r}; list them with GET /api/v1/{listing}")


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "form")]
    # discriminated unions put the tag in the location ("body.builtin.samples"): keep it readable
    return ".".join(parts) or "request"


def describe_validation(errors: list[dict[str, Any]]) -> str:
    """One line per problem: ``field: what is wrong (got value)``."""
    lines = []
    for err in errors:
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            msg = "unknown field; check its spelling against the API schema (/docs)"
        elif kind == "missing":
            msg = "required field is missing"
        elif kind == "json_invalid":
            msg = f"body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
        got = err.get("input")
        shown = "" if kind in ("missing", "json_invalid") or isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        field = _field(tuple(err.get("loc", ())))
        # a whole-body rule's message names its own fields ("alpha_min (0.8) must not exceed alpha_max")
        lines.append(f"{msg}{shown}" if field == "request" and kind == "value_error" else f"{field}: {msg}{shown}")
    return "; ".join(lines)


def storage_detail(request: Request, exc: BaseException) -> str:
    """What a full disk met by a request tells the client: which place (by its setting, never an
    absolute path), how much is free there, and what to do."""
    state = request.app.state
    if isinstance(exc, DBAPIError):  # the job/metadata store's file system, not the artifacts'
        url = state.settings.resolved_database_url()
        free = free_bytes(url.removeprefix("sqlite:///").rsplit("/", 1)[0] or "/") if url.startswith("sqlite:///") else None
        where = "the database (MOELAB_DATABASE_URL)" if state.settings.database_url else "MOELAB_DATA_DIR (the database)"
        return (f"no space left under {where}: {human_bytes(free)} free; free space there (DELETE unused conversions, "
                "fine-tunes or profiles) or move it to a larger disk, then repeat the request")
    return state.store.storage_error(exc).message


def _storage_response(request: Request, exc: BaseException) -> JSONResponse:
    detail = storage_detail(request, exc)
    log.error("%s %s: %s (%s)", request.method, request.url.path, detail, exc if not isinstance(exc, InsufficientStorage) else "refused up front")
    return JSONResponse({"detail": detail}, status_code=507)


def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(
        {"detail": f"internal error ({type(exc).__name__}); this is a bug in moelab, the server log has the traceback"},
        status_code=500,
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        clean = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]
        return JSONResponse({"detail": describe_validation(errors), "errors": jsonable_encoder(clean)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None and is_disk_full(exc.__cause__):
            # FastAPI reports a body it could not spool (multipart parts go to the temporary dir) as a 400
            import tempfile

            detail = (f"no space left in the server's temporary dir (TMPDIR), where uploads are spooled: "
                      f"{human_bytes(free_bytes(tempfile.gettempdir()))} free; free space there, then repeat the request")
            log.error("%s %s: %s", request.method, request.url.path, detail)
            return JSONResponse({"detail": detail}, status_code=507)
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = "no such endpoint; see /docs for the API"
        if exc.status_code == 405:
            detail = "method not allowed on this endpoint; see /docs for the API"
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(IntegrityError)
    async def _conflict(request: Request, exc: IntegrityError) -> JSONResponse:
        # a row this request refers to was deleted (or the same one created) by a concurrent request
        log.warning("integrity conflict on %s %s: %s", request.method, request.url.path, exc.orig)
        return JSONResponse(
            {"detail": "a concurrent change conflicts with this request (a resource it refers to was deleted or created "
                       "meanwhile); look the resources up again and repeat it"},
            status_code=409,
        )

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> JSONResponse:
        # a full disk or quota (ENOSPC/EDQUOT) anywhere in the request is 507 Insufficient Storage: the
        # operator's to fix, not a bug; any other OSError stays the 500 it was
        if is_disk_full(exc):
            return _storage_response(request, exc)
        return _internal(request, exc)

    @app.exception_handler(DBAPIError)
    async def _database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        if isinstance(exc, IntegrityError):
            return await _conflict(request, exc)
        if is_disk_full(exc):  # SQLite: "database or disk is full"
            return _storage_response(request, exc)
        return _internal(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if is_disk_full(exc):  # a library's wrapper of ENOSPC (torch, safetensors, Arrow)
            return _storage_response(request, exc)
        return _internal(request, exc)


# --------------------------------------------------------------------------- the contract of errors

#: every error body: one line saying what was wrong and what to do
ERROR_SCHEMA = {"title": "Error", "type": "object", "required": ["detail"],
                "properties": {"detail": {"type": "string", "title": "Detail", "description": "what was wrong and what to do"}}}
#: a 422 from validation: the same line, and the per-field list it was made from
VALIDATION_SCHEMA = {
    "title": "HTTPValidationError", "type": "object", "required": ["detail"],
    "properties": {
        "detail": {"type": "string", "title": "Detail", "description": "one line per problem: 'field: what is wrong (got value)'"},
        "errors": {"type": "array", "title": "Errors", "items": {
            "type": "object", "required": ["loc", "msg", "type"],
            "properties": {"loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
                           "msg": {"type": "string"}, "type": {"type": "string"}}}},
    },
}
_STATUS_WORDS = {400: "Bad request", 401: "Missing or wrong MOELAB_API_TOKEN", 403: "Refused by the server's settings",
                 404: "No such resource or endpoint", 409: "Conflicts with the resource's state", 413: "Request body too large",
                 422: "Invalid input", 429: "Busy: too many at once, retry later", 503: "The job queue (Redis) is not reachable",
                 507: "No space left to store it"}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Make the OpenAPI schema say what the error handlers above send: ``{"detail": str}`` for every error
    (``{"detail": str, "errors": [...]}`` for a 422 of validation, not FastAPI's default list), on every status
    code an operation answers with. Besides the codes a route declares, any operation may answer 401 (the
    token gate), 404 (an unknown id in its path), 422 (a NUL in its URL, bad parameters), 413 and 507 (a
    body too large for the limit or the disk), and a 500 is a bug reported in the same shape: "4XX" and
    "5XX" cover them."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    schemas["HTTPValidationError"] = VALIDATION_SCHEMA
    schemas.pop("ValidationError", None)
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    validation = {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}}
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            for code, response in responses.items():
                if code.isdigit() and int(code) >= 400:
                    response["content"] = validation if code == "422" else error
                    if response.get("description") in (None, "", HTTPStatus(int(code)).phrase):  # a route's own words stay
                        response["description"] = _STATUS_WORDS.get(int(code), HTTPStatus(int(code)).phrase)
            if "{" in path:
                responses.setdefault("404", {"description": _STATUS_WORDS[404], "content": error})
            if path.startswith("/api/v1/") and path != "/api/v1/health":
                responses.setdefault("401", {"description": _STATUS_WORDS[401], "content": error})
            responses.setdefault("4XX", {"description": "Any other refusal, in words", "content": error})
            responses.setdefault("5XX", {"description": "A bug (500) or the server's state (503, 507), in words", "content": error})
    return schema

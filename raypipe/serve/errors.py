"""OpenAI-style error bodies `{"error": {"message", "type", "param", "code"}}` and their HTTP statuses.

Everything the caller got wrong arrives here as `raypipe.errors.InvalidInput` (from the HTTP layer,
preprocessing, prompt building or sampling validation); its `code` picks the status. A replica
or actor that died or is unreachable mid-request (and a full engine queue) is a 503 the client may
retry. Anything else is a 500 whose message does not leak internals.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException

from raypipe.errors import CapacityError, InvalidInput
from raypipe.serve.error_body import REPLICA_UNAVAILABLE, REPLICA_UNAVAILABLE_MESSAGE, error_body

# InvalidInput codes that are not a plain 400.
_STATUS_BY_CODE = {"invalid_api_key": 401, "model_not_found": 404, "previous_response_not_found": 404,
                   "lora_not_found": 404, "lora_adapter_not_found": 404, "request_too_large": 413}


# A process serving the request went away (Serve restarts it): the same request may succeed on retry.
_UNAVAILABLE = (RayActorError, ActorDiedError, ActorUnavailableError, BackPressureError, DeploymentUnavailableError)


def replica_lost(exc: BaseException) -> bool:
    """Whether `exc` says the replica running a call died or cannot be reached (not what the call raised)."""
    return isinstance(_cause(exc), (RayActorError, ActorUnavailableError))  # ActorDiedError is a RayActorError


def _cause(exc: BaseException) -> BaseException:
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause  # raised in another deployment: the original, not its traceback dump
    return exc


class ApiError(Exception):
    """An error with its HTTP status decided; `code` also labels the error metric."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def from_exception(cls, exc: BaseException) -> "ApiError":
        if isinstance(exc, ApiError):
            return exc
        exc = _cause(exc)
        if isinstance(exc, InvalidInput):
            # Sampling fields are top-level request fields in the HTTP API.
            param = exc.item.removeprefix("sampling_params.") if exc.item else None
            return cls(_STATUS_BY_CODE.get(exc.code, 400), str(exc), exc.code, param)
        if isinstance(exc, CapacityError):
            return cls(503, str(exc) or "server is at capacity, retry later", "overloaded")
        if isinstance(exc, _UNAVAILABLE):
            return cls(503, REPLICA_UNAVAILABLE_MESSAGE, REPLICA_UNAVAILABLE)
        return cls(500, f"internal error ({type(exc).__name__})", "internal_error")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (unknown route, wrong method, ...) speak the same format."""

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, str(exc.detail), code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return ApiError(400, f"{where}: {first.get('msg')}", "invalid_request").response()

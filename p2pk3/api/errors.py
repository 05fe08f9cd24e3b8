"""`ApiError`: an HTTP error in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and the
mapping of the cluster's `RequestError` codes onto HTTP statuses."""

from __future__ import annotations

from aiohttp import web

# RequestError.code (node/client.py, transport/messages.ErrorCode) -> (HTTP status, OpenAI error type)
_CLUSTER_CODES = {
    "busy": (429, "rate_limit_exceeded"),  # the entry's queue is full (node/admission.py)
    "queue_timeout": (503, "service_unavailable"),  # waited the queue timeout without a free session
    "unavailable": (503, "service_unavailable"),
    "connection_lost": (503, "service_unavailable"),
    "unreachable": (503, "service_unavailable"),
    "bad_request": (400, "invalid_request_error"),
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # sent as the Retry-After header (seconds)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad_param(param: str, message: str) -> ApiError:
    """A 400 naming the field: `param` is set and the message starts with the field's name."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def from_cluster(code: str, message: str, retry_after: int | None = None) -> ApiError:
    """The HTTP error for a failed cluster request (unknown codes: 500); `retry_after`: the entry's advice."""
    status, kind = _CLUSTER_CODES.get(code, (500, "server_error"))
    return ApiError(status, f"the cluster answered {code}: {message}", type=kind, code=code, retry_after=retry_after)

"""One error type for every dialect: status, message and the offending field; dialects render it."""

from __future__ import annotations

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "overloaded_error",
}


class RequestError(Exception):
    """A request that cannot be served as sent; `param` names the offending field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def error_type(self) -> str:
        return ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")


def invalid(param: str, message: str) -> RequestError:
    """A 400 for one field, with the field named in the message as well."""
    return RequestError(f"{param}: {message}", 400, param)

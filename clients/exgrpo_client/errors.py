"""Errors raised by the SDK.

    ExgrpoError                     anything this package raises on purpose
    ├── APIError                    the service answered with an error (status, title, detail, request_id)
    │   ├── BadRequest (400, 422)   the request breaks the contract or a rule (K mismatch, bad field)
    │   ├── Unauthorized (401)      no or unknown bearer token
    │   ├── Forbidden (403)         the token lacks the scope
    │   ├── NotFound (404)          unknown pool, run, batch, task or question
    │   ├── Conflict (409)          the state does not allow it (name taken, batch abandoned, lease lost)
    │   ├── PayloadTooLarge (413)   request body over the service's limit: send smaller chunks
    │   ├── RateLimited (429)       retried with back-off first; raised once the retries are spent
    │   └── ServerError (5xx)       the service failed; 502/503/504 are retried first
    └── TransportError              the service could not be reached or the connection broke

`str(error)` of an `APIError` starts with the service's own `detail` message, so printing the
error tells what to change. Every `APIError` carries the `request_id` the service logged.
Arguments that fail the wire contract before anything is sent raise `pydantic.ValidationError`
(a `ValueError`), as the schemas are shared with the service.
"""

from __future__ import annotations

from typing import Any


class ExgrpoError(Exception):
    """Base class of every error the SDK raises on purpose."""


class TransportError(ExgrpoError):
    """The request did not get an answer: connection refused, reset or timed out.

    Raised after the retries are spent; `__cause__` is the underlying `httpx` exception."""

    def __init__(self, message: str, *, method: str, url: str) -> None:
        super().__init__(message)
        self.method = method
        self.url = url


class APIError(ExgrpoError):
    """The service answered with an error status and an RFC 9457 problem body."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        request_id: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        method: str = "",
        url: str = "",
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.request_id = request_id
        self.errors = errors
        self.method = method
        self.url = url

    def __str__(self) -> str:
        where = f"; request_id {self.request_id}" if self.request_id else ""
        return f"{self.detail} ({self.status} {self.title}{where})"

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(status={self.status}, detail={self.detail!r}, request_id={self.request_id!r})"


class BadRequest(APIError):
    """400 or 422: the request breaks the wire contract or one of the pool's rules."""


class Unauthorized(APIError):
    """401: no bearer token, or one the service does not know."""


class Forbidden(APIError):
    """403: the token is valid but lacks the scope (read, write:<pool>, admin)."""


class NotFound(APIError):
    """404: the pool, run, batch, task or question does not exist."""


class Conflict(APIError):
    """409: the current state does not allow the request."""


class PayloadTooLarge(APIError):
    """413: the request body is over the service's limit."""


class RateLimited(APIError):
    """429: too many requests, still refused after the retries."""


class ServerError(APIError):
    """5xx: the service (or a proxy in front of it) failed."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: BadRequest,
    429: RateLimited,
}


def error_class(status: int) -> type[APIError]:
    """The exception class for an HTTP error status."""
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, APIError)

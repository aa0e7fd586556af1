"""Errors raised by the service layer. One handler in `app.py` turns them into problem+json.

ServiceError (500)
├── BadRequest (422)        input that passed the schema but breaks a rule (K mismatch, lengths)
├── NotFound (404)          unknown pool, run, batch, task, question
├── Conflict (409)          state does not allow it (batch abandoned, lease lost, name taken)
├── Unauthorized (401)      no or unknown bearer token
├── Forbidden (403)         token lacks the scope
└── PayloadTooLarge (413)   request body over the configured limit
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    title = "Internal error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class BadRequest(ServiceError):
    status = 422
    title = "Invalid request"


class NotFound(ServiceError):
    status = 404
    title = "Not found"


class Conflict(ServiceError):
    status = 409
    title = "Conflict"


class Unauthorized(ServiceError):
    status = 401
    title = "Unauthorized"


class Forbidden(ServiceError):
    status = 403
    title = "Forbidden"


class PayloadTooLarge(ServiceError):
    status = 413
    title = "Payload too large"

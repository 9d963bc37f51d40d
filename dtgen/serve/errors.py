"""The errors a server maps to HTTP statuses (and a CLI to its exit status)."""
from __future__ import annotations


class RequestError(ValueError):
    """A user error in one field of a request: the CLI exits 2 with it, the server answers
    422. `field` is the request's own name for it (the CLI maps it to its flag)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Cancelled(Exception):
    """Every rank stops a request at the same step: a DELETE, a deadline, a client gone."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

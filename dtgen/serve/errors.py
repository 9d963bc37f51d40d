"""The errors a server maps to HTTP statuses. `RequestError` (422, and a CLI's exit status 2)
is the core's (dtgen/requests.py: a request checks itself without the server); it is
re-exported here, the same class."""
from __future__ import annotations

from dtgen.requests import RequestError

__all__ = ["Cancelled", "RequestError"]


class Cancelled(Exception):
    """Every rank stops a request at the same step: a DELETE, a deadline, a client gone."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

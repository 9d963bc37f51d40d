"""A serve adapter's request fields as one table, and what every adapter does with it alike.

An entry maps a JSON name to a `Field`: the request attribute it sets (None: a field the
adapter reads itself, OpenAI's `n` or `size`), what form text becomes, and the routes that
take it. From the table come the form coercion, the request values (a step cache parsed,
its errors named `step_cache.<knob>`) and the request's own check with each error under the
field's JSON name, so a new request field reaches a server with one entry.
"""
from __future__ import annotations

from dataclasses import dataclass

from dtgen.requests import renamed
from dtgen.step_cache import StepCacheError, parse_step_cache

from .errors import RequestError
from .forms import coerce


@dataclass(frozen=True)
class Field:
    attr: str | None             # the request's attribute (None: read by the adapter itself)
    type: type | None = str      # what form text becomes; None: any JSON value (the request checks it)
    routes: tuple[str, ...] = ("generations", "edits")


class FieldTable:
    def __init__(self, fields: dict[str, Field], shared: dict[str, str] | None = None):
        """`shared`: request attributes that one JSON field stands for ({"width": "size", ...})."""
        self.fields = fields
        self.json_names = {f.attr: name for name, f in fields.items() if f.attr is not None} | (shared or {})

    def names(self, route: str | None = None) -> list[str]:
        """The JSON names a route takes (None: every route's)."""
        return [name for name, f in self.fields.items() if route is None or route in f.routes]

    def read(self, fields: dict, form: bool) -> dict:
        """The fields given: JSON values as they are, form text as each field's type."""
        return coerce(fields, {name: f.type or str for name, f in self.fields.items()}) if form else fields

    def values(self, fields: dict) -> dict:
        """The request attributes that `fields` (all of them in the table) set."""
        values = {self.fields[k].attr: v for k, v in fields.items() if self.fields[k].attr is not None}
        if "step_cache" in values:
            try:
                values["step_cache"] = parse_step_cache(values["step_cache"])
            except StepCacheError as e:
                raise RequestError(f"step_cache.{e.knob}", e.message) from None
        return values

    def checked(self, request, *args, **kwargs):
        """`request` once `request.check(*args, **kwargs)` passes; its error under the JSON name."""
        try:
            request.check(*args, **kwargs)
        except RequestError as e:
            raise renamed(e, self.json_names) from None
        return request

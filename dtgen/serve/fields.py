"""A serve adapter's request fields as one table, built from the request's declaration
(dtgen/schema.py), and what every adapter does with it alike.

The table is the request class's declared fields (a JSON name each, a size standing for
width and height) and the fields the adapter keeps itself (OpenAI's `n`, a video's `fps`),
declared alike. From it come the form coercion, the JSON type errors and unknown fields, the
request values (a size parsed, a step cache parsed with its errors named `step_cache.<knob>`),
the request's own check with each error under the field's JSON name, and the defaults `/info`
shows; a new request field reaches a server with its declaration alone.
"""
from __future__ import annotations

from dtgen import schema
from dtgen.requests import RequestError, renamed

from .forms import coerce


class FieldTable(schema.Fields):
    def __init__(self, request: type, extra=()):
        """`request`: the request dataclass; `extra`: the fields the adapter reads itself
        (`schema.extra_field`)."""
        super().__init__(request, extra)
        self.fields = {s.json: s for s in self.specs if s.json}

    def names(self, route: str | None = None) -> list[str]:
        """The JSON names a route takes (None: every route's)."""
        return [name for name, s in self.fields.items() if route is None or route in s.routes]

    def read(self, fields: dict, form: bool) -> dict:
        """The fields given: JSON values as they are, form text as each field's type."""
        return coerce(fields, {name: s.form_type for name, s in self.fields.items()}) if form else fields

    def check_names(self, fields: dict, route: str | None = None) -> None:
        """No field outside the route's, and every required one given."""
        accepted = self.names(route)
        unknown = sorted(k for k in fields if k not in accepted)
        if unknown:
            raise RequestError(unknown[0], f"unknown field; accepted: {', '.join(accepted)}")
        self.check_required(fields, route)

    def check_required(self, fields: dict, route: str | None = None) -> None:
        for name in self.names(route):
            if self.fields[name].required and name not in fields:
                raise RequestError(name, "is required")

    def check_types(self, fields: dict) -> None:
        """Each value given (all of them in the table) of its field's JSON type."""
        for name, value in fields.items():
            schema.check_type(self.fields[name], value, name)

    def values(self, fields: dict) -> dict:
        """The request attributes that `fields` (all of them in the table) set: a size as its
        width and height ("auto", where the field takes it: the defaults'), a step cache as
        its config."""
        values = {}
        for name, value in fields.items():
            spec = self.fields[name]
            if not spec.attrs:
                continue
            if spec.kind == "size":
                if not (spec.auto and value == "auto"):
                    values.update(schema.parse_size_value(spec, value, name))
            elif spec.kind == "step_cache":
                values[spec.name] = schema.parse_step_cache_value(spec, value, name, knob_names=True)
            elif spec.kind == "loras":
                values[spec.name] = schema.parse_loras(value, name)
            else:
                values[spec.name] = value
        return values

    def checked(self, request, *args, **kwargs):
        """`request` once `request.check(*args, **kwargs)` passes; its error under the JSON name."""
        try:
            request.check(*args, **kwargs)
        except RequestError as e:
            raise renamed(e, self.json_names()) from None
        return request

    def defaults(self, request, route: str | None = None, **extra) -> dict:
        """What `/info` shows as the defaults: each optional JSON field of `request` (a size
        as WIDTHxHEIGHT) and of the adapter's own, given in `extra` by name."""
        out = {}
        for name in self.names(route):
            spec = self.fields[name]
            if spec.attrs and not spec.required:
                out[name] = schema.json_value(spec, request)
            elif spec.name in extra:
                out[name] = extra[spec.name]
        return out

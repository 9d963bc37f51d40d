"""A request's fields, each declared once, and what every front end makes of the declaration.

A model's request dataclass declares each field a user may set with `request_field(...)`: its
default, help, bounds or choices, and its CLI flag and JSON name where they are not the
attribute's (`--flag-name`, `name`). From that one declaration come:

- the command's flags (`add_flags`), the request they make (`from_args`) and the flag each
  field's errors are named by (`flag_names`; `dtgen.requests.flag_line` writes the line);
- the bounds part of the request's own check (`check_bounds`, called by its `check`, which
  keeps only what needs the model: side multiples, whole latent frames, position budgets);
- the server's table (dtgen/serve/fields.py `FieldTable`): form coercion, JSON type errors,
  unknown fields, defaults, errors under JSON names;
- the markdown option table of the docs (`table`; `python -m dtgen.schema --model M`).

    @dataclass(frozen=True)
    class T2IRequest:
        prompt: str = request_field(help="what to draw")
        steps: int = request_field(50, low=1, high=MAX_STEPS, json="num_inference_steps",
                                   flag_default=None, help="denoising steps (default: 50)")
        height: int = request_field(1024, low=1, high=MAX_SIDE, unit="px", flag=None, json=None)
        width: int = request_field(1024, low=1, high=MAX_SIDE, unit="px", flag=None, json=None)
        size = size_field(example="1024x1024", flag="--image-size")   # "WIDTHxHEIGHT": width and height

A field whose user name stands for several attributes (`size`: width and height) is a class
attribute of the request made by `size_field`; it takes the place of its first attribute in
the flags and tables. Fields a front end reads that are not request attributes (OpenAI's `n`,
a video's `fps`) are declared alike with `extra_field` and kept by the front end.

A field's errors are `RequestError(attribute, message)` as everywhere (dtgen/requests.py);
the front ends rename the attribute to their own name.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Iterable

from dtgen.requests import (MAX_SEED, MAX_SIDE, MAX_STEPS, RequestError, check_int, check_number, check_step_cache,
                            check_text, parse_size)
from dtgen.step_cache import StepCacheError, describe, parse_step_cache

KEY = "dtgen.schema"     # the dataclass field metadata key holding a field's Spec
SAME = object()          # a flag's default: the request's own
KINDS = ("text", "int", "number", "choice", "bool", "step_cache", "size", "loras", "any")
# What a field's kind reads as in tables and type errors.
TYPE_NAMES = {"text": "string", "int": "integer", "number": "number", "choice": "string", "bool": "boolean",
              "step_cache": "step cache", "size": "WIDTHxHEIGHT", "loras": "adapters", "any": "any"}


@dataclass(frozen=True)
class Spec:
    """One field a user sets, by flag or JSON, as declared. `attrs`: the request attributes it
    sets (its own name; a size's width and height; none for a field the front end keeps)."""
    name: str | None
    kind: str                       # one of KINDS
    default: object = MISSING       # the request's default; MISSING: the request has none
    help: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False          # (low, high] rather than [low, high]
    choices: tuple = ()
    empty_ok: bool = True           # text: "" and blanks allowed
    unit: str = ""                  # in bounds errors and tables: "must be >= 1 and <= 4096 px"
    note: str = ""                  # after the bounds in errors: "must be >= 0 (0: off)"
    flag: str | None = None         # the CLI flag; None: none
    flag_default: object = SAME     # the flag's default where a command fills the value in later
    metavar: str | None = None
    json: str | None = None         # the JSON (and form) name; None: not a server field
    required: bool = False          # in a JSON body
    routes: tuple[str, ...] = ("generations", "edits")
    attrs: tuple[str, ...] = ()
    example: str = ""               # size: a size of the model, for the message
    auto: bool = False              # size: the server takes "auto" (its default size)
    methods: tuple[str, ...] | None = None   # step_cache: the methods the model runs (None: all)
    model: str | None = None                 # step_cache: the model's name, for that message
    form: type | None = None        # "any": what form text becomes (default: text)

    @property
    def dest(self) -> str:
        """The flag's attribute on argparse's namespace."""
        return self.flag[2:].replace("-", "_")

    @property
    def form_type(self) -> type:
        """What multipart form text becomes (dtgen.serve.forms.coerce)."""
        return {"int": int, "number": float, "bool": bool}.get(self.kind, self.form or str)


def _make(name: str | None, default, kind: str | None = None, empty_ok: bool | None = None,
          required: bool | None = None, flag=True, json=True, choices: Iterable = (),
          routes: Iterable[str] = ("generations", "edits"), methods: Iterable[str] | None = None, **options) -> Spec:
    """A Spec from a declaration's keywords (Spec's fields), with what is read off the default:
    the kind, whether a text may be blank, whether a JSON body must give it."""
    if kind is None:
        kind = ("choice" if choices else "bool" if isinstance(default, bool) else "int" if isinstance(default, int)
                else "number" if isinstance(default, float) else "text" if default is MISSING or
                isinstance(default, str) else None)
    if kind not in KINDS:
        raise ValueError(f"request field {name or ''}: give its kind (one of {', '.join(KINDS)}), got {kind!r}")
    if flag not in (None, True) and not str(flag).startswith("--"):
        raise ValueError(f"request field {name or ''}: a flag starts with --, got {flag!r}")
    return Spec(name, kind, default, flag=flag, json=json, choices=tuple(choices), routes=tuple(routes),
                empty_ok=isinstance(default, str) and not default.strip() if empty_ok is None else empty_ok,
                required=default is MISSING if required is None else required,
                methods=None if methods is None else tuple(methods), **options)


def request_field(default=MISSING, **options):
    """A request dataclass field a user sets (see the module docstring); `options` are Spec's
    fields.

    `kind` is read off the default where it can be (int, float, str, bool; "choice" with
    `choices`); else give it: "text", "int", "number", "choice", "bool", "step_cache", "any".
    A number field whose default is None takes None too. `flag`/`json`: True (the default)
    names it after the attribute (`--max-new-tokens`, `max_new_tokens`), a string names it,
    None leaves it out. `flag_default`: the flag's default when a command fills the value in
    later ("the checkpoint's", "4 on the tiny default"); `required`: in a JSON body (default:
    when the request has no default). A text field is non-empty unless `empty_ok` (default:
    when its default is blank)."""
    return dataclasses.field(default=default, metadata={KEY: _make(None, default, **options)})


def size_field(*, example: str, flag: str | None = "--image-size", json: str | None = "size",
               flag_default=None, attrs: tuple[str, str] = ("width", "height"), **options) -> Spec:
    """A "WIDTHxHEIGHT" field standing for the request's width and height attributes: a class
    attribute of the request (its name is the attribute's). `example`: a size of the model
    (for the message); `auto=True`: the server takes "auto" for its default size."""
    return _make(None, MISSING, kind="size", required=False, flag=flag, json=json, flag_default=flag_default,
                 attrs=tuple(attrs), example=example, **options)


def extra_field(name: str, default=None, flag: str | None = None, **options) -> Spec:
    """A field a front end reads that is no request attribute (OpenAI's `n`, a video's `fps`):
    declared like `request_field`, kept by the front end (`check_value` checks it). No flag
    unless given one."""
    return _named(_make(name, default, flag=flag, required=options.pop("required", False), **options), name)


def _named(spec: Spec, name: str, attrs: tuple[str, ...] | None = None) -> Spec:
    flag = "--" + name.replace("_", "-") if spec.flag is True else spec.flag
    json = name if spec.json is True else spec.json
    return dataclasses.replace(spec, name=name, flag=flag, json=json, attrs=spec.attrs if attrs is None else attrs)


_SPECS: dict[type, tuple[Spec, ...]] = {}


def specs(request) -> tuple[Spec, ...]:
    """A request class's fields in order (a size field where its first attribute is), or
    the specs themselves when given specs (extra fields, or a `Fields`)."""
    if isinstance(request, Fields):
        return request.specs
    if not isinstance(request, type):
        return tuple(request)
    if request not in _SPECS:
        fields = [f for f in dataclasses.fields(request) if KEY in f.metadata]
        out = [_named(f.metadata[KEY], f.name, (f.name,)) for f in fields]
        for name, value in vars(request).items():
            if isinstance(value, Spec):
                composite = _named(value, name)
                names = [s.name for s in out]
                missing = [a for a in composite.attrs if a not in names]
                if missing:
                    raise ValueError(f"{request.__name__}.{name} stands for {', '.join(composite.attrs)}; "
                                     f"not request fields: {', '.join(missing)}")
                out.insert(min(names.index(a) for a in composite.attrs), composite)
        _SPECS[request] = tuple(out)
    return _SPECS[request]


class Fields:
    """A request class's fields and the ones its front end adds, in that order: what one
    model's front ends take (dtgen/serve/fields.py builds the server's table on it; the docs
    table lists it)."""

    def __init__(self, request: type, extra: Iterable[Spec] = ()):
        self.request = request
        self.specs = specs(request) + tuple(extra)
        names = [s.json for s in self.specs if s.json]
        if len(set(names)) != len(names):
            raise ValueError(f"{request.__name__}: a JSON name is given twice: {names}")

    def flag_names(self) -> dict[str, str]:
        return flag_names(self.specs)

    def json_names(self) -> dict[str, str]:
        return json_names(self.specs)

    def table(self) -> str:
        return table(self.specs, self.request)


# ---- names ------------------------------------------------------------------------------------
def _names(fields, name_of) -> dict[str, str]:
    """Attribute -> the front end's name: its own, else that of the field standing for it (a
    size's, for width and height)."""
    out = {}
    for composite in (False, True):
        for spec in specs(fields):
            if (len(spec.attrs) > 1) == composite and name_of(spec):
                for attr in spec.attrs:
                    out.setdefault(attr, name_of(spec))
    return out


def flag_names(fields) -> dict[str, str]:
    """Attribute -> its CLI flag (width and height -> --image-size where a size flag stands for
    them): `dtgen.requests.flag_line`'s names."""
    return _names(fields, lambda s: s.flag)


def json_names(fields) -> dict[str, str]:
    """Attribute -> its JSON name (width and height -> size)."""
    return _names(fields, lambda s: s.json)


# ---- values -----------------------------------------------------------------------------------
def _bound_text(spec: Spec) -> str:
    def number(v):
        return str(int(v)) if spec.kind == "int" else f"{v:g}"
    lo = "" if spec.low is None else f"{'>' if spec.low_open else '>='} {number(spec.low)}"
    hi = "" if spec.high is None else f"<= {number(spec.high)}"
    return " and ".join(p for p in (lo, hi) if p)


def check_type(spec: Spec, value, name: str | None = None) -> None:
    """A JSON value of the field's type, or `RequestError(name, ...)` (the messages of the
    bounds check, so a field reads alike however it is refused)."""
    name = name or spec.json or spec.name
    kind = spec.kind
    if kind in ("text", "choice", "size"):
        if not isinstance(value, str):
            raise RequestError(name, "must be a non-empty string" if kind == "text" and not spec.empty_ok
                               else f"must be a string, got {value!r}")
    elif kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(name, f"must be an integer, got {value!r}")
    elif kind == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise RequestError(name, f"must be a number, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise RequestError(name, f"must be true or false, got {value!r}")


def check_value(spec: Spec, value, name: str | None = None) -> None:
    """The field's type and bounds, or `RequestError(name, ...)` (default: the attribute's)."""
    name = name or spec.name
    kind, note = spec.kind, (f" {spec.unit}" if spec.unit else "") + (f" ({spec.note})" if spec.note else "")
    if value is None and spec.default is None and kind in ("int", "number"):
        return
    if kind == "text":
        check_text(name, value, empty_ok=spec.empty_ok)
    elif kind == "int":
        if spec.low is not None:
            check_int(name, value, int(spec.low), None if spec.high is None else int(spec.high), note=note)
        else:
            check_type(spec, value, name)
            if spec.high is not None and value > spec.high:
                raise RequestError(name, f"must be {_bound_text(spec)}{note}, got {value}")
    elif kind == "number":
        if spec.low is not None and spec.high is not None:
            check_number(name, value, spec.low, spec.high, low_ok=not spec.low_open)
        else:
            check_type(spec, value, name)
            low_bad = spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low))
            if low_bad or (spec.high is not None and value > spec.high):
                raise RequestError(name, f"must be {_bound_text(spec)}{note}, got {value:g}")
    elif kind == "choice":
        if value not in spec.choices:
            raise RequestError(name, f"must be {_choices_text(spec.choices)}, got {value!r}")
    elif kind == "bool":
        check_type(spec, value, name)
    elif kind == "step_cache":
        check_step_cache(value, spec.model, spec.methods)
    elif kind == "loras":
        parse_loras(value, name)


def _choices_text(choices: tuple) -> str:
    quoted = [repr(c) for c in choices]
    return " or ".join(quoted) if len(quoted) <= 2 else "one of " + ", ".join(quoted)


def check_bounds(request, skip: Iterable[str] = ()) -> None:
    """Each declared attribute of `request` within its type, bounds and choices, in order:
    `RequestError(attribute, message)` for the first that is not (`skip`: attributes this
    request does not use). The request's `check` calls it and adds what only the model knows."""
    skip = set(skip)
    for spec in specs(type(request)):
        if spec.attrs == (spec.name,) and spec.name not in skip:
            check_value(spec, getattr(request, spec.name))


def parse_size_value(spec: Spec, text, name: str) -> dict:
    """A size field's "WIDTHxHEIGHT" -> {width: ..., height: ...} (`RequestError(name, ...)`)."""
    width, height = parse_size(text, name, spec.example)
    return dict(zip(spec.attrs, (width, height)))


def parse_step_cache_value(spec: Spec, value, name: str, knob_names: bool = False):
    """A step cache's config from its text or dict form; `RequestError`: under `name` with
    "knob: message" (a CLI flag's line), or under "name.knob" (`knob_names`: a JSON field)."""
    try:
        return parse_step_cache(value)
    except StepCacheError as e:
        if knob_names:
            raise RequestError(f"{name}.{e.knob}", e.message) from None
        raise RequestError(name, f"{e.knob}: {e.message}") from None


def parse_loras(value, name: str = "loras") -> tuple[tuple[str, float], ...]:
    """LoRA adapters a request carries: [{"name": N, "weight": W}, ...] (weight default 1.0) or
    (name, weight) pairs -> ((name, weight), ...); `RequestError` naming the entry's key."""
    if not isinstance(value, (list, tuple)):
        raise RequestError(name, f'must be a list of {{"name": ..., "weight": ...}}, got {value!r}')
    out = []
    for i, entry in enumerate(value):
        where = f"{name}[{i}]"
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"name", "weight"})
            if unknown:
                raise RequestError(f"{where}.{unknown[0]}", 'unknown key (an adapter has "name" and "weight")')
            adapter, weight = entry.get("name"), entry.get("weight", 1.0)
        elif isinstance(entry, (list, tuple)) and len(entry) == 2:
            adapter, weight = entry
        else:
            raise RequestError(where, f'must be {{"name": ..., "weight": ...}}, got {entry!r}')
        if not isinstance(adapter, str) or not adapter.strip():
            raise RequestError(f"{where}.name", f"must be a non-empty string (a loaded adapter), got {adapter!r}")
        if (not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight != weight
                or abs(weight) == float("inf")):
            raise RequestError(f"{where}.weight", f"must be a finite number, got {weight!r}")
        if adapter in (a for a, _ in out):
            raise RequestError(f"{where}.name", f"{adapter!r} is given twice")
        out.append((adapter, float(weight)))
    return tuple(out)


def json_value(spec: Spec, request):
    """The field's value in `request`, as a JSON body gives it (a size as "WIDTHxHEIGHT", a
    step cache as its dict form)."""
    if spec.kind == "size":
        return "x".join(str(getattr(request, a)) for a in spec.attrs)
    value = getattr(request, spec.name)
    if spec.kind == "step_cache":
        return describe(parse_step_cache(value))
    if spec.kind == "loras":
        return [{"name": n, "weight": w} for n, w in parse_loras(value, spec.name)]
    return value


# ---- the fields every diffusion request declares alike (Wan's, Qwen-Image's) ---------------------
STEP_CACHE_HELP = ("fewer full DiT evaluations (dtgen/step_cache.py): first-block[:threshold=0.05], "
                   "taylorseer[:interval=5,disable_before=3,order=1,...], magcache:mag_ratios=R0/R1/... "
                   "(or magcache:calibrate=true to measure them), taylor[:interval=5,order=2,...]; "
                   "default: every step in full")


def prompt_field(makes: str):
    """The required prompt; `makes`: "image" or "video" (its help: what it shows)."""
    return request_field(help=f"what the {makes} shows")


def negative_prompt_field(default: str = "", help: str = "what CFG steers away from"):
    return request_field(default, help=help)


def reference_image_field(help: str):
    """A reference image (`dtgen.reference_images.ReferenceImage`): `--image FILE` on the
    command line, the multipart file `input_reference` on the server (OpenAI's videos API name);
    the front ends open and check the file."""
    return request_field(None, kind="any", flag="--image", json="input_reference", metavar="FILE", help=help)


def seed_field():
    return request_field(0, low=0, high=MAX_SEED, help="the initial noise's seed")


def steps_field(default: int = 50, tiny: int = 4):
    """The denoising steps: `num_inference_steps` in JSON (diffusers' name); the flag's default is
    the command's (`default` on a checkpoint, `tiny` on the tiny default)."""
    return request_field(default, low=1, high=MAX_STEPS, json="num_inference_steps", flag_default=None,
                         help=f"denoising steps (default: {default}, or {tiny} on the tiny default)")


def step_cache_field():
    """A step cache (dtgen/step_cache.py): a config, its text or dict form; None runs every step in full."""
    return request_field(None, kind="step_cache", help=STEP_CACHE_HELP)


def loras_field():
    """The LoRA adapters a request's rows carry (dtgen/lora): ((name, weight), ...), their deltas
    added. The CLI fills it from its --lora FILE[:WEIGHT] flags (the name is the file); a server
    request names adapters loaded with POST /v1/loras (or the server's --lora files)."""
    return request_field((), kind="loras", flag=None, json="loras",
                         help='LoRA adapters applied to this request: [{"name": N, "weight": W}] (weight default 1), '
                              "each loaded on the server (POST /v1/loras); the CLI's --lora FILE[:WEIGHT]")


def side_field(default: int, help: str, **options):
    """A height or width in pixels: no JSON name of its own (the request's `size_field` stands for it)."""
    return request_field(default, low=1, high=MAX_SIDE, unit="px", json=None, help=help, **options)


# OpenAI's image-generation fields every image server takes alike (the answer's encoding,
# `output_format` and `output_compression`, is the server's: dtgen.serve.adapters); their
# values are checked by `dtgen.requests.check_image_fields`.
MODEL_FIELD = extra_field("model", None, kind="text", empty_ok=True, help="OpenAI's model name: accepted, ignored")
OPENAI_IMAGE_FIELDS = (
    extra_field("n", 1, help="images per request: 1 (one image a request)"),
    extra_field("response_format", "b64_json", choices=("b64_json",), help="how the image comes back"),
    MODEL_FIELD,
    extra_field("user", None, kind="text", empty_ok=True, help="OpenAI's end-user id: accepted, ignored"),
)


# ---- the command line -------------------------------------------------------------------------
def add_flags(parser, fields, omit: Iterable[str] = (), defaults: dict | None = None) -> None:
    """A flag for each field of `fields` (a request class, or extra fields) that has one, in
    order. `omit`: attributes whose flag this parser leaves out (a server's prompt);
    `defaults`: flag defaults by attribute that the command owns (its default prompt)."""
    omit, defaults = set(omit), defaults or {}
    for spec in specs(fields):
        if spec.flag is None or spec.name in omit:
            continue
        if spec.name in defaults:
            default = defaults[spec.name]
        elif spec.flag_default is not SAME:
            default = spec.flag_default
        else:
            default = None if spec.default is MISSING else spec.default
        kwargs = {"default": default, "help": spec.help.replace("%", "%%") or None}
        if spec.kind == "bool":
            # off by default: a switch (--ignore-eos); else --flag / --no-flag
            parser.add_argument(spec.flag, action="store_true" if default is False else
                                argparse.BooleanOptionalAction, **kwargs)
            continue
        if spec.kind in ("int", "number"):
            kwargs["type"] = int if spec.kind == "int" else float
        if spec.choices:
            kwargs["choices"] = list(spec.choices)
        if spec.metavar or spec.kind == "step_cache":
            kwargs["metavar"] = spec.metavar or "METHOD[:KNOB=VALUE,...]"
        parser.add_argument(spec.flag, **kwargs)


def from_args(request: type, args, **overrides):
    """The request the flags in `args` say (`add_flags`'s), the fields without a flag at their
    defaults, `overrides` on top. A size flag is parsed and a step cache read into its config
    here: `RequestError` under the flag (the size) or the attribute (the rest), as `check`'s."""
    values = {}
    for spec in specs(request):
        if spec.flag is None or not hasattr(args, spec.dest) or (spec.attrs and set(spec.attrs) <= set(overrides)):
            continue
        value = getattr(args, spec.dest)
        if spec.kind == "size":
            values.update(parse_size_value(spec, value, spec.flag))
        elif spec.kind == "step_cache":
            values[spec.name] = parse_step_cache_value(spec, value, spec.name)
        else:
            values[spec.name] = value
    return request(**{**values, **overrides})


# ---- the docs ---------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default_text(spec: Spec, request: type | None) -> str:
    if spec.kind == "size" and request is not None:
        defaults = {f.name: f.default for f in dataclasses.fields(request)}
        return "`" + "x".join(str(defaults[a]) for a in spec.attrs) + "`"
    if spec.required or spec.default is MISSING:
        return "required" if spec.required else "-"
    if spec.default is None:
        return "none"
    return f"`{spec.default!r}`" if isinstance(spec.default, str) else f"`{spec.default}`"


def bounds_text(spec: Spec) -> str:
    """The field's bounds as the docs table says them."""
    unit = f" {spec.unit}" if spec.unit else ""
    if spec.kind in ("int", "number") and (spec.low is not None or spec.high is not None):
        text = _bound_text(spec) + unit + (f" ({spec.note})" if spec.note else "")
        return text + ("; none allowed" if spec.default is None else "")
    if spec.kind == "choice":
        return ", ".join(f"`{c}`" for c in spec.choices)
    if spec.kind == "text":
        return "any" if spec.empty_ok else "non-empty"
    if spec.kind == "size":
        return "WIDTHxHEIGHT" + (" or `auto`" if spec.auto else "")
    if spec.kind == "loras":
        return 'a list of {"name": ..., "weight": ...}; weight finite (default 1)'
    if spec.kind == "step_cache":
        methods = ", ".join(spec.methods) if spec.methods else "any method"
        return f"METHOD[:KNOB=VALUE,...] or an object ({methods}); none: every step in full"
    return "-"


def table(fields, request: type | None = None) -> str:
    """The markdown table of the fields: flag, JSON name, type, default, bounds, help."""
    request = fields.request if isinstance(fields, Fields) else fields if isinstance(fields, type) else request
    rows = ["| field | flag | JSON | type | default | bounds | help |", "|---|---|---|---|---|---|---|"]
    for spec in specs(fields):
        kind = TYPE_NAMES[spec.kind] if spec.kind != "any" else {int: "integer", float: "number"}.get(
            spec.form, "any")
        routes = "" if set(spec.routes) >= {"generations", "edits"} or not spec.json else \
            f" ({', '.join(spec.routes)} only)"
        name = f"`{spec.name}`" + (f" ({', '.join(spec.attrs)})" if spec.attrs not in ((), (spec.name,)) else "")
        cells = (name, f"`{spec.flag}`" if spec.flag else "-", (f"`{spec.json}`" + routes) if spec.json else "-",
                 kind, _default_text(spec, request), bounds_text(spec), spec.help)
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def model_fields(name: str) -> Fields:
    """A registered model's fields (its spec's `fields`, else its request's alone)."""
    import importlib
    from dtgen.registry import MODEL_REGISTRY
    spec = importlib.import_module(MODEL_REGISTRY).spec(name)
    return spec.load("fields") if spec.fields else Fields(spec.load("request"))


BEGIN = "<!-- generated by `python -m dtgen.schema --model {name}`: edit the request's declaration, not this -->"
END = "<!-- end of the generated table -->"


def generated_blocks(text: str) -> dict[str, str]:
    """The models' tables a docs page holds between `BEGIN` and `END`: name -> table."""
    import re
    pattern = re.escape(BEGIN).replace(re.escape("{name}"), r"([\w-]+)") + r"\n(.*?)" + re.escape(END)
    return dict(re.findall(pattern, text, flags=re.S))


def update_page(text: str) -> str:
    """`text` with each generated table written anew from its model's declaration."""
    for name, old in generated_blocks(text).items():
        text = text.replace(BEGIN.format(name=name) + "\n" + old + END,
                            BEGIN.format(name=name) + "\n" + model_fields(name).table() + END)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtgen.schema",
                                     description="a model's request fields as a markdown table")
    parser.add_argument("--model", help="a registered model (dtgen models)")
    parser.add_argument("--update", metavar="PAGE", help="rewrite the generated tables of this docs page instead")
    args = parser.parse_args(argv)
    if args.update:
        from pathlib import Path
        page = Path(args.update)
        page.write_text(update_page(page.read_text()))
        return 0
    if not args.model:
        parser.error("give --model or --update")
    print(model_fields(args.model).table(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

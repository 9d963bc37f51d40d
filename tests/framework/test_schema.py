"""The request schema (dtgen/schema.py): a field declared once gives the CLI's flags and the
request they make, the flag its errors name, the bounds check, the server's JSON and form
fields (dtgen/serve/fields.py) and the docs' table; the models' declarations keep the names
and defaults their hand-written tables had, and docs/requests.md is what they generate."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtgen import schema
from dtgen.requests import MAX_SIDE, MAX_STEPS, RequestError, check_int, check_number, flag_line
from dtgen.schema import extra_field, request_field, size_field
from dtgen.serve.fields import FieldTable

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Toy:
    prompt: str = request_field(help="what to draw")
    negative_prompt: str = request_field("", help="what | to avoid")
    height: int = request_field(48, low=1, high=MAX_SIDE, unit="px", flag=None, json=None, help="px")
    width: int = request_field(64, low=1, high=MAX_SIDE, unit="px", flag=None, json=None, help="px")
    size = size_field(example="64x48", auto=True, help="WIDTHxHEIGHT")
    steps: int = request_field(4, low=1, high=MAX_STEPS, json="num_inference_steps", flag_default=None,
                               help="denoising steps (default: 4)")
    scale: float = request_field(4.0, low=0.0, high=10.0, low_open=True, flag="--cfg", help="the CFG weight")
    scale_2: float | None = request_field(None, kind="number", low=0.0, high=10.0, help="the second weight")
    sampler: str = request_field("euler", choices=("euler", "unipc", "dpm"), help="the sampler")
    mode: str = request_field("serial", choices=("serial", "batch"), json=None, help="the CFG rows")
    fast: bool = request_field(False, json=None, help="cut corners")
    top_k: int = request_field(8, low=0, note="0: off", json=None, help="k")
    system_prompt: str = request_field("", routes=("edits",), help="an edit's")
    step_cache: object = request_field(None, kind="step_cache", methods=("taylor", "taylorseer"), model="Toy",
                                       help="fewer full steps")
    internal: int = 3       # set by code, no user field

    def check(self) -> None:
        schema.check_bounds(self)


FPS = extra_field("fps", 16, low=1, high=120, flag="--fps", help="frames per second")
FIELDS = FieldTable(Toy, (FPS, extra_field("seconds", None, kind="number", help="length")))


def _error(fn) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn()
    return e.value


def _parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    schema.add_flags(p, Toy, **kwargs)
    return p


def test_the_declaration_orders_the_fields_and_names_them():
    names = [s.name for s in schema.specs(Toy)]
    # the size stands where its first attribute is; code-only attributes are no user field
    assert names[:5] == ["prompt", "negative_prompt", "size", "height", "width"] and "internal" not in names
    assert schema.flag_names(Toy) == {
        "prompt": "--prompt", "negative_prompt": "--negative-prompt", "width": "--image-size",
        "height": "--image-size", "steps": "--steps", "scale": "--cfg", "scale_2": "--scale-2",
        "sampler": "--sampler", "mode": "--mode", "fast": "--fast", "top_k": "--top-k",
        "system_prompt": "--system-prompt", "step_cache": "--step-cache"}
    assert schema.json_names(Toy)["width"] == "size" and schema.json_names(Toy)["steps"] == "num_inference_steps"
    assert "mode" not in schema.json_names(Toy)
    assert FIELDS.names("generations") == ["prompt", "negative_prompt", "size", "num_inference_steps", "scale",
                                           "scale_2", "sampler", "step_cache", "fps", "seconds"]
    assert "system_prompt" in FIELDS.names("edits") and FIELDS.fields["prompt"].required


def test_flags_are_generated_with_their_types_defaults_and_help():
    p = _parser(defaults={"prompt": "a fox"})
    args = p.parse_args([])
    assert (args.prompt, args.negative_prompt, args.image_size, args.steps, args.cfg, args.scale_2, args.sampler,
            args.fast, args.step_cache) == ("a fox", "", None, None, 4.0, None, "euler", False, None)
    args = p.parse_args(["--steps", "3", "--cfg", "2.5", "--fast", "--sampler", "dpm", "--top-k", "0"])
    assert (args.steps, args.cfg, args.fast, args.sampler, args.top_k) == (3, 2.5, True, "dpm", 0)
    with pytest.raises(SystemExit):
        p.parse_args(["--sampler", "ddim"])        # choices: argparse refuses them
    text = p.format_help()
    assert "denoising steps (default: 4)" in text and "--step-cache METHOD[:KNOB=VALUE,...]" in text
    assert "--height" not in text and "--internal" not in text and "--no-fast" not in text
    # a server's parser leaves out what each request gives
    assert "--prompt" not in _parser(omit=("prompt",)).format_help()


def test_args_make_the_request_and_bad_flags_name_the_flag():
    p = _parser(defaults={"prompt": "a fox"})
    args = p.parse_args(["--image-size", "32x16", "--steps", "3", "--step-cache", "taylor:interval=2"])
    req = schema.from_args(Toy, args)
    assert (req.prompt, req.width, req.height, req.steps, req.internal) == ("a fox", 32, 16, 3, 3)
    assert req.step_cache.method == "taylor" and req.step_cache.interval == 2
    assert schema.from_args(Toy, args, width=8, height=8, prompt="x").width == 8     # overrides win
    flags = schema.flag_names(Toy)

    def line(argv) -> str:     # the command fills the size in first (flag_default None)
        return flag_line(_error(lambda: schema.from_args(Toy, p.parse_args(["--image-size", "64x48", "--steps", "4",
                                                                             *argv])).check()), flags)

    assert line(["--image-size", "big"]) == "--image-size 'big' is not 'WIDTHxHEIGHT' (e.g. 64x48)"
    assert line(["--image-size", "5000x16"]) == "--image-size width must be >= 1 and <= 4096 px, got 5000"
    assert line(["--step-cache", "taylor:interval=0"]) == "--step-cache interval: must be >= 1, got 0"
    assert line(["--step-cache", "first-block"]) == \
        "--step-cache Toy runs the step caches taylor, taylorseer; got 'first-block'"
    assert line(["--cfg", "0"]) == "--cfg must be > 0 and <= 10, got 0"
    assert line(["--steps", "0"]) == "--steps must be >= 1 and <= 1000, got 0"


@pytest.mark.parametrize("fields, field, message", [
    (dict(prompt=" "), "prompt", "must be a non-empty string"),
    (dict(prompt=3), "prompt", "must be a non-empty string"),
    (dict(negative_prompt=None), "negative_prompt", "must be a string, got None"),
    (dict(steps=0), "steps", "must be >= 1 and <= 1000, got 0"),
    (dict(steps=2.0), "steps", "must be an integer, got 2.0"),
    (dict(width=0), "width", "must be >= 1 and <= 4096 px, got 0"),
    (dict(scale=0.0), "scale", "must be > 0 and <= 10, got 0"),
    (dict(scale=math.nan), "scale", "must be a number, got nan"),
    (dict(scale_2=11.0), "scale_2", "must be >= 0 and <= 10, got 11"),
    (dict(sampler="ddim"), "sampler", "must be one of 'euler', 'unipc', 'dpm', got 'ddim'"),
    (dict(mode="both"), "mode", "must be 'serial' or 'batch', got 'both'"),
    (dict(fast=1), "fast", "must be true or false, got 1"),
    (dict(top_k=-1), "top_k", "must be >= 0 (0: off), got -1"),
    (dict(step_cache="taylor:order=9"), "step_cache", "order: must be >= 0 and <= 4, got 9"),
])
def test_bounds_errors_name_the_field(fields, field, message):
    e = _error(lambda: Toy(**{"prompt": "a fox", **fields}).check())
    assert (e.field, e.message) == (field, message)


def test_the_bounds_read_as_the_shared_checks_and_none_is_the_default_of_an_optional_number():
    Toy("a fox", scale_2=None).check()
    Toy("a fox", scale_2=0.0, step_cache="taylorseer").check()
    steps = next(s for s in schema.specs(Toy) if s.name == "steps")
    scale = next(s for s in schema.specs(Toy) if s.name == "scale")
    for value in (0, 1001, "3", True):
        mine = _error(lambda: schema.check_value(steps, value))
        theirs = _error(lambda: check_int("steps", value, 1, MAX_STEPS))
        assert str(mine) == str(theirs)
    for value in (0, 10.5, "x", math.nan):
        assert str(_error(lambda: schema.check_value(scale, value))) == \
            str(_error(lambda: check_number("scale", value, 0.0, 10.0, low_ok=False)))


@pytest.mark.parametrize("fields, field, message", [
    ({"prompt": "x", "num_inference_steps": "2"}, "num_inference_steps", "must be an integer, got '2'"),
    ({"prompt": "x", "num_inference_steps": True}, "num_inference_steps", "must be an integer, got True"),
    ({"prompt": "x", "scale": "high"}, "scale", "must be a number, got 'high'"),
    ({"prompt": "x", "scale_2": None}, "scale_2", "must be a number, got None"),
    ({"prompt": "x", "seconds": math.nan}, "seconds", "must be a number, got nan"),
    ({"prompt": 3}, "prompt", "must be a non-empty string"),
    ({"prompt": "x", "size": 64}, "size", "must be a string, got 64"),
    ({"prompt": "x", "sampler": 1}, "sampler", "must be a string, got 1"),
])
def test_json_values_of_the_wrong_type_name_the_json_field(fields, field, message):
    e = _error(lambda: FIELDS.check_types(fields))
    assert (e.field, e.message) == (field, message)
    FIELDS.check_types({"prompt": "x", "step_cache": {"method": "taylor"}, "num_inference_steps": 2, "scale": 1})


def test_json_names_unknown_fields_values_and_errors_under_the_json_name():
    assert _error(lambda: FIELDS.check_names({"prompt": "x", "guidance": 3})).message.startswith(
        "unknown field; accepted: prompt, negative_prompt, size, num_inference_steps, ")
    assert _error(lambda: FIELDS.check_names({"prompt": "x", "system_prompt": "y"}, "generations")).field == \
        "system_prompt"
    FIELDS.check_names({"prompt": "x", "system_prompt": "y"}, "edits")
    assert str(_error(lambda: FIELDS.check_names({"size": "64x48"}))) == "prompt: is required"
    assert FIELDS.values({"prompt": "x", "size": "32x16", "num_inference_steps": 2, "fps": 8}) == \
        {"prompt": "x", "width": 32, "height": 16, "steps": 2}
    assert FIELDS.values({"size": "auto"}) == {}      # the defaults' size
    assert str(_error(lambda: FIELDS.values({"size": "32"}))) == "size: '32' is not 'WIDTHxHEIGHT' (e.g. 64x48)"
    assert _error(lambda: FIELDS.values({"step_cache": "taylor:interval=0"})).field == "step_cache.interval"
    assert FIELDS.values({"step_cache": {"method": "taylor", "interval": 3}})["step_cache"].interval == 3
    # the request's own check, its attributes renamed; one JSON name for two attributes says which
    e = _error(lambda: FIELDS.checked(Toy("x", width=5000)))
    assert str(e) == "size: width must be >= 1 and <= 4096 px, got 5000"
    assert str(_error(lambda: FIELDS.checked(Toy("x", steps=0)))) == \
        "num_inference_steps: must be >= 1 and <= 1000, got 0"
    assert str(_error(lambda: FIELDS.checked(Toy("x", mode="x")))) == "mode: must be 'serial' or 'batch', got 'x'"


def test_form_text_becomes_each_fields_type():
    form = FIELDS.read({"prompt": "x", "num_inference_steps": "3", "scale": "2.5", "size": "32x16", "fps": "8",
                        "step_cache": "taylor", "other": "7"}, form=True)
    assert form == {"prompt": "x", "num_inference_steps": 3, "scale": 2.5, "size": "32x16", "fps": 8,
                    "step_cache": "taylor", "other": "7"}
    assert str(_error(lambda: FIELDS.read({"num_inference_steps": "three"}, form=True))) == \
        "num_inference_steps: must be an integer, got 'three'"
    assert str(_error(lambda: FIELDS.read({"scale": "x"}, form=True))) == "scale: must be a number, got 'x'"
    assert FIELDS.read({"num_inference_steps": "3"}, form=False) == {"num_inference_steps": "3"}   # JSON as is


def test_the_defaults_are_the_optional_json_fields_of_the_default_request():
    from dtgen.step_cache import TaylorConfig
    defaults = FIELDS.defaults(Toy("a fox", width=32, step_cache=TaylorConfig(interval=3)), fps=12)
    assert defaults["size"] == "32x48" and defaults["num_inference_steps"] == 4 and defaults["fps"] == 12
    assert defaults["step_cache"]["method"] == "taylor" and defaults["step_cache"]["interval"] == 3
    assert "prompt" not in defaults and "seconds" not in defaults and "mode" not in defaults
    assert "system_prompt" not in FIELDS.defaults(Toy("a"), route="generations")


def test_a_field_adapters_keep_checks_like_a_request_field():
    assert schema.check_value(FPS, 16) is None
    assert str(_error(lambda: schema.check_value(FPS, 0))) == "fps: must be >= 1 and <= 120, got 0"
    assert str(_error(lambda: schema.check_value(FPS, 0, "--fps"))) == "--fps: must be >= 1 and <= 120, got 0"


def test_the_docs_table_has_a_row_a_field():
    text = schema.table(FIELDS)
    lines = text.splitlines()
    assert lines[0] == "| field | flag | JSON | type | default | bounds | help |"
    assert len(lines) == 2 + len(FIELDS.specs)
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert row["`size` (width, height)"] == ("| `size` (width, height) | `--image-size` | `size` | WIDTHxHEIGHT | "
                                            "`64x48` | WIDTHxHEIGHT or `auto` | WIDTHxHEIGHT |")
    assert row["`steps`"] == ("| `steps` | `--steps` | `num_inference_steps` | integer | `4` | >= 1 and <= 1000 | "
                              "denoising steps (default: 4) |")
    assert row["`scale`"].split(" | ")[5] == "> 0 and <= 10"
    assert "what \\| to avoid" in row["`negative_prompt`"]           # a pipe in a help stays in its cell
    assert row["`prompt`"].split(" | ")[4] == "required"
    assert row["`system_prompt`"].split(" | ")[2] == "`system_prompt` (edits only)"
    assert row["`height`"].split(" | ")[1:3] == ["-", "-"]


def test_declarations_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="give its kind"):
        request_field(None)
    with pytest.raises(ValueError, match="a flag starts with --"):
        request_field(1, flag="steps")

    @dataclass
    class Sizeless:
        width: int = request_field(1, low=1)
        size = size_field(example="1x1")

    with pytest.raises(ValueError, match="stands for width, height; not request fields: height"):
        schema.specs(Sizeless)

    @dataclass
    class Twice:
        a: int = request_field(1, json="x")
        b: int = request_field(1, json="x")

    with pytest.raises(ValueError, match="a JSON name is given twice"):
        schema.Fields(Twice)


# What the models' hand-written tables said before the declarations made them: the same names
# (a field declared since is added, none is lost).
FLAGS_BEFORE = {
    "qwen-image": {"prompt": "--prompt", "width": "--image-size", "height": "--image-size", "steps": "--steps",
                   "true_cfg_scale": "--true-cfg-scale", "seed": "--seed", "step_cache": "--step-cache"},
    "wan": {"height": "--height", "width": "--width", "num_frames": "--num-frames", "steps": "--steps",
            "guidance_scale": "--guidance", "guidance_scale_2": "--guidance-2", "shift": "--flow-shift",
            "sampler": "--sampler", "seed": "--seed", "step_cache": "--step-cache", "image": "--image"},
    "hunyuan-image3": {"prompt": "--prompt", "seed": "--seed", "steps": "--steps", "guidance": "--guidance",
                       "flow_shift": "--flow-shift", "image_size": "--image-size",
                       "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                       "top_p": "--top-p", "cfg_mode": "--cfg-mode", "step_cache": "--step-cache"},
}
JSON_BEFORE = {
    "qwen-image": ({"prompt": "prompt", "negative_prompt": "negative_prompt", "seed": "seed",
                    "steps": "num_inference_steps", "true_cfg_scale": "true_cfg_scale", "step_cache": "step_cache",
                    "width": "size", "height": "size", "loras": "loras"},
                   {"size", "n", "response_format", "model", "user"}),
    "wan": ({"prompt": "prompt", "negative_prompt": "negative_prompt", "num_frames": "num_frames",
             "steps": "num_inference_steps", "guidance_scale": "guidance_scale",
             "guidance_scale_2": "guidance_scale_2", "shift": "flow_shift", "sampler": "sampler", "seed": "seed",
             "step_cache": "step_cache", "width": "size", "height": "size", "image": "input_reference",
             "loras": "loras"},
            {"size", "seconds", "fps", "model"}),
    "hunyuan-image3": ({"prompt": "prompt", "seed": "seed", "steps": "num_inference_steps",
                        "guidance": "guidance_scale", "max_new_tokens": "max_new_tokens", "image_size": "size",
                        "step_cache": "step_cache", "system_prompt": "system_prompt", "loras": "loras"},
                       {"size", "n", "response_format", "model", "user"}),
}
# The request flags' defaults before (None: the command fills them in from the checkpoint or
# the tiny default).
DEFAULTS_BEFORE = {
    "qwen-image": dict(negative_prompt=" ", image_size=None, steps=None, true_cfg_scale=4.0, seed=0, step_cache=None),
    "wan": dict(negative_prompt="", height=None, width=None, num_frames=None, steps=None, guidance=5.0,
                guidance_2=None, flow_shift=None, sampler="unipc", seed=0, step_cache=None, fps=16, image=None),
    "hunyuan-image3": dict(seed=0, steps=None, guidance=None, flow_shift=None, image_size="auto",
                           max_new_tokens=None, ignore_eos=False, temperature=0.6, top_k=1024, top_p=0.95,
                           cfg_mode=None, step_cache=None, system_prompt=""),
}


@pytest.mark.parametrize("model", sorted(FLAGS_BEFORE))
def test_each_model_declares_the_names_and_defaults_its_tables_had(model):
    from models import registry
    spec = registry.spec(model)
    fields = spec.load("fields")
    assert fields.request is spec.load("request")
    flags = fields.flag_names()
    assert {k: flags.get(k) for k in FLAGS_BEFORE[model]} == FLAGS_BEFORE[model]
    attrs, own = JSON_BEFORE[model]
    assert {k: fields.json_names().get(k) for k in attrs} == attrs
    assert set(fields.fields) == set(attrs.values()) | own
    args = spec.load("cli").build_parser(cli=True).parse_args([])
    assert {k: getattr(args, k) for k in DEFAULTS_BEFORE[model]} == DEFAULTS_BEFORE[model]


def test_the_docs_page_shows_the_tables_the_declarations_make(capsys):
    page = (ROOT / "docs" / "requests.md").read_text()
    from models import registry
    blocks = schema.generated_blocks(page)
    assert sorted(blocks) == sorted(registry.names()), "docs/requests.md: a model's table is missing"
    for name, table in blocks.items():
        assert table == schema.model_fields(name).table(), \
            f"docs/requests.md: {name}'s table is stale; run python -m dtgen.schema --update docs/requests.md"
    assert schema.update_page(page) == page
    assert schema.main(["--model", "wan"]) == 0 and capsys.readouterr().out == blocks["wan"]


def test_the_schema_is_core_the_server_builds_on_it():
    """dtgen/schema.py imports nothing of dtgen.serve (the server imports the core); the
    server's table is a `schema.Fields`."""
    import ast
    tree = ast.parse((ROOT / "dtgen" / "schema.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "dtgen.requests" in imported and not [m for m in imported if m and m.startswith("dtgen.serve")]
    assert isinstance(FIELDS, schema.Fields)

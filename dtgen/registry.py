"""The framework's contract with a model: one `ModelSpec` each, and finding a model by name or
by its checkpoint folder.

dtgen knows no model: the list lives in `models/registry.py`, each model declaring its spec in
`models/<m>/spec.py`. A spec names its pieces as "module" or "module:attribute" strings and
imports nothing of the model, so reading every spec (to detect a checkpoint, to list
`--model` choices) loads no model code: a server for one model never imports another's.

What a spec's pieces must offer:
- `loader`: `load(checkpoint, plan, rank=0, world_size=1, dtype=float32, device="cpu", ...)`,
  this rank's share of the model (`dtgen.build.build` over the model's `ModelAdapter`);
- `cli` (the model's command, which `dtgen run` and `dtgen serve` drive: its module
  `models.<m>.cli`, or an object in it, "models.<m>.cli:COMMAND" (a
  `dtgen.diffusion_command.DiffusionCommand`); None for a model no command runs, as the docs'
  tiny DiT), offering:
  `build_parser(prog, description, cli=True)` (with
  `cli=False` without the flags only the CLI reads, plus any server-only flags of the model),
  `finish_args(args)` (the launch defaults: world size, plan), `prepare(args) -> (problem or
  None, tiny)`, `build_pipeline(ctx, args)`, `request_from_args(args)` (the request every
  field not given comes from), `main(argv, prog)` (the command itself: `dtgen run` runs it),
  and for the server `serve_adapter(ctx, args, max_batch)` (this rank's `dtgen.serve`
  adapter) with an optional `serve_problem(args)` (server-only checks);
- `plans` (a placements module): `PLANS`, name -> `dtgen.plan.Plan`;
- `request`: the request dataclass; its `check(...)` raises `RequestError(field, message)`
  (dtgen/requests.py), the one check of the CLI and the server alike;
- `tiny`: a function writing the tiny default checkpoint once and returning its folder;
- `fields` (optional, "module:attribute"): a `dtgen.schema.Fields`, the request's fields and
  those its server adds (the server's table; the docs' option table lists them).
`buckets` is data: the request fields that are the shapes a model buckets (dtgen/buckets.py).
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .buckets import ShapeBuckets

# The module that lists the models (`models/registry.py`): dtgen imports it by this name, when a
# command needs it, so that its core imports no model.
MODEL_REGISTRY = "models.registry"


@dataclass(frozen=True)
class ModelSpec:
    name: str                       # the --model value, e.g. "wan"
    title: str                      # in messages, e.g. "Wan"
    makes: str                      # "image" or "video": the server's routes
    detect: Callable[[Path], bool]  # is this folder a checkpoint of this model (its layout)?
    layout: str                     # what detect looks for, said when a folder is not one
    loader: str                     # "module:function", the model's load (see the module docstring)
    plans: str                      # the placements module
    request: str                    # "module:Class", the request dataclass
    tiny: str                       # "module:function", the tiny default's folder
    buckets: ShapeBuckets           # the request fields its compiled shapes (and batches) are keyed on
    cli: str | None = None          # "module" or "module:attribute": the model's command (module docstring)
    fields: str | None = None       # "module:attribute", its front ends' fields (dtgen/schema.py)

    def __post_init__(self):
        if self.makes not in ("image", "video"):
            raise ValueError(f"model spec {self.name!r}: makes must be 'image' or 'video', got {self.makes!r}")

    @property
    def batches(self) -> bool:
        """Whether the server may run several requests' denoise steps as one batch."""
        return bool(self.buckets.batch)

    @property
    def cli_module(self) -> str | None:
        """The module of the model's command (spawned ranks import it first), or None."""
        return None if self.cli is None else self.cli.partition(":")[0]

    def load(self, piece: str):
        """The spec's piece ("loader", "cli", "plans", "request", "tiny", "fields"), imported now."""
        target = getattr(self, piece)
        if target is None:
            raise ValueError(f"{self.title} has no {piece}")
        return resolve(target)


def resolve(target: str):
    """"module" -> the module; "module:attribute" -> the attribute."""
    module, _, attribute = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def diffusers_class(folder: Path) -> str | None:
    """The pipeline class a diffusers-format folder names (model_index.json's `_class_name`),
    or None when the folder is not one."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        return None
    try:
        return str(json.loads(index.read_text()).get("_class_name"))
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class DiffusersFolder:
    """A spec's `detect`: a diffusers-format folder whose model_index.json names `pipeline`, or
    one of the spec's other pipelines (`also`: Wan's image-to-video beside its text-to-video)."""
    pipeline: str   # the diffusers pipeline class, e.g. "WanPipeline"
    also: tuple[str, ...] = ()

    def __call__(self, folder: Path) -> bool:
        return diffusers_class(folder) in (self.pipeline, *self.also)


def find(specs: Iterable[ModelSpec], name: str) -> ModelSpec:
    specs = list(specs)
    for spec in specs:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown model {name!r}; known: {', '.join(s.name for s in specs)}")


def detect(specs: Iterable[ModelSpec], folder: str | Path) -> ModelSpec:
    """The one model whose layout `folder` holds; ValueError (one line) when none does."""
    specs, path = list(specs), Path(folder)
    if not path.is_dir():
        raise ValueError(f"--checkpoint {folder}: no such folder")
    found = [s for s in specs if s.detect(path)]
    if len(found) == 1:
        return found[0]
    if found:   # two layouts claim one folder: a spec's detect is too loose
        raise ValueError(f"--checkpoint {folder}: looks like {' and '.join(s.title for s in found)}; give --model")
    named = diffusers_class(path)
    what = f"a diffusers folder of {named!r}" if named else "no checkpoint of a known model"
    raise ValueError(f"--checkpoint {folder}: {what}; known: " + "; ".join(f"{s.title} ({s.layout})" for s in specs))


def checkpoint_problem(specs: Iterable[ModelSpec], spec: ModelSpec, folder: str, missing: str) -> str | None:
    """For a model's own CLI: None when `folder` is `spec`'s layout; else one line, naming the
    model it holds when another spec claims it (`missing`: what to say when none does)."""
    path = Path(folder)
    if path.is_dir() and spec.detect(path):
        return None
    other = next((s for s in specs if s is not spec and path.is_dir() and s.detect(path)), None)
    if other is not None:
        runs = f" (dtgen run --model {other.name} runs it)" if other.cli else ""
        return f"--checkpoint {folder} holds {other.title}; this runs {spec.title}{runs}"
    named = diffusers_class(path)
    if named is not None:
        return f"--checkpoint {folder}: a diffusers folder of {named!r}; {spec.title}'s is {spec.layout}"
    return f"--checkpoint {folder}: {missing}"

"""The models dtgen serves and runs: each declares its `ModelSpec` in `models/<m>/spec.py`.

Reading a spec imports nothing of its model (dtgen/registry.py), so walking them all, to
detect a checkpoint or list `--model` choices, loads no model code.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from dtgen import registry
from dtgen.registry import ModelSpec

# In this order: --model's choices, and the first is the default without --checkpoint.
SPEC_MODULES = ("models.hunyuan_image3.spec", "models.wan.spec", "models.qwen_image.spec")


def specs() -> list[ModelSpec]:
    return [importlib.import_module(m).SPEC for m in SPEC_MODULES]


def names() -> list[str]:
    return [s.name for s in specs()]


def default() -> ModelSpec:
    return specs()[0]


def spec(name: str) -> ModelSpec:
    return registry.find(specs(), name)


def detect(folder: str | Path) -> ModelSpec:
    """The model a checkpoint folder holds; ValueError (one line) when none, or no folder."""
    return registry.detect(specs(), folder)


def checkpoint_problem(name: str, folder: str, missing: str) -> str | None:
    """A model's CLI: None when `folder` is its checkpoint, else one line (which model it holds)."""
    return registry.checkpoint_problem(specs(), spec(name), folder, missing)

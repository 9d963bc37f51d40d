"""Reading a component's config.json into a frozen dataclass whose fields are its keys.

The checks every model's config reader makes, written once: keys starting with `_` are
metadata (`_class_name`, `_diffusers_version`); any other key the dataclass does not know is
refused (a silent default could change the architecture) unless the reader keeps such keys
aside; list values become tuples (the dataclass is frozen and hashable). What a model
refuses beyond that (an unsupported variant's switch) stays in its own `from_dict`.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable


def read_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def config_values(cls, d: dict[str, Any], where: str, *, exclude: Iterable[str] = (), also_known: Iterable[str] = (),
                  refuse_unknown: bool = True, skip_none: bool = False, tuples: Iterable[str] = ()) -> dict[str, Any]:
    """The entries of `d` that are fields of the dataclass `cls` (less `exclude`), as keyword
    arguments. `refuse_unknown`: a key that is neither metadata, a field nor in `also_known`
    raises ValueError("{where}: unknown key(s) [...]"). `skip_none`: a null value leaves the
    field's default. `tuples`: fields whose list values become tuples."""
    names = {f.name for f in fields(cls)} - set(exclude)
    if refuse_unknown:
        known = names | set(also_known)
        unknown = [k for k in d if not k.startswith("_") and k not in known]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}")
    kw = {k: d[k] for k in names if k in d and not (skip_none and d[k] is None)}
    for k in tuples:
        if k in kw:
            kw[k] = tuple(kw[k])
    return kw


class JsonConfig:
    """For a config dataclass with a `from_dict`: `from_json(path)` reads the file and calls it."""

    @classmethod
    def from_json(cls, path: str | Path):
        return cls.from_dict(read_json(path))

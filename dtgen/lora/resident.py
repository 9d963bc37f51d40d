"""Adapters resident beside one copy of the base weights, applied unmerged, per batch row.

y = base(x) + sum_k w_k s_k B_k (A_k x), s_k = alpha_k / r_k: the base weight (float, bf16 or
FP8) is never touched. Every targeted linear gets one forward hook (registered ahead of the
phase controller's reduce hooks), which adds the deltas of the adapters its batch rows carry.

Sharding is derived, not declared per model: a pair is split as its base weight's plan rule
says (`dtgen.storage.ParamSpec` of `<module>.weight`), through the same storage code:
- rows split (COLUMN, COLUMN_KV_GROUPS, PAIR, VOCAB): A whole, B split like the weight's rows
  (same unit: whole heads stay whole);
- columns split (ROW): A split like the weight's columns, B whole; the delta is then a partial
  sum like the base output, and the controller's reduce hook sums both at once;
- REPLICATE: both whole.
Each phase uses the view of that shard its micros select, as the base weight does.

Which adapters a row carries is set by the caller per step (`set_rows`, the denoise loop), or
`default` for every row: nothing about requests is baked into the modules.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..plan import Rule
from ..storage import ParamSpec, ResidentStorage, load_resident
from .files import LoraError, LoraFile, read_lora

# A row's adapters: (name, weight) pairs, applied summed.
RowAdapters = tuple[tuple[str, float], ...]


class _TensorReader:
    """`dtgen.checkpoint.CheckpointReader.read` over tensors in memory (the adapter's pairs), so
    the storage's own slicing shards them exactly like the base weights."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.tensors[key]
        return t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)


def pair_specs(weight: ParamSpec, rank: int) -> tuple[ParamSpec, ParamSpec]:
    """The specs of A [r, in] and B [out, r] for a base weight [out, in] split as `weight` says."""
    if weight.stacked:
        raise LoraError(f"LoRA on stacked expert weights ({weight.keys[0]}, ...) is not supported")
    out, inp = weight.official_shape
    plain = ParamSpec(keys=("A",), rule=Rule.REPLICATE, official_shape=(rank, inp))
    if weight.rule == Rule.ROW:
        a = replace(plain, rule=Rule.ROW, unit=weight.unit, unit_name=weight.unit_name)
        return a, ParamSpec(keys=("B",), rule=Rule.REPLICATE, official_shape=(out, rank))
    b = ParamSpec(keys=("B",), rule=weight.rule, official_shape=(out, rank), micro_packed=weight.micro_packed,
                  unit=weight.unit, unit_name=weight.unit_name)
    return plain, b


def _key_of(path: str, prefixed: bool, prefixes: dict[str, str], shapes: dict) -> str | None:
    """The checkpoint key of the base weight a file's module path names (longest prefix first;
    a PEFT folder's unprefixed paths take the "" entry), or None."""
    for prefix, target in sorted(prefixes.items(), key=lambda kv: -len(kv[0])):
        if bool(prefix) == prefixed and path.startswith(prefix):
            key = target + path[len(prefix):] + ".weight"
            if key in shapes:
                return key
    return None


def match_keys(lora: LoraFile, prefixes: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Module path in the file -> the checkpoint key of its base weight, through the model's name
    map `prefixes` (`ModelAdapter.lora_prefixes`); `shapes`: checkpoint key -> official shape.
    One line for paths that match nothing (how many, a few, what the model's linears are named
    like) and for a pair whose shape does not fit its weight."""
    if not prefixes:
        raise LoraError(f"LoRA {lora.path}: this model declares no LoRA name map (ModelAdapter.lora_prefixes)")
    found = {p: _key_of(p, lora.prefixed, prefixes, shapes) for p in lora.layers}
    missing = sorted(p for p, k in found.items() if k is None)
    if missing:
        matched = sorted(p for p, k in found.items() if k is not None)
        what = "it looks like an adapter for another model" if not matched else \
            f"matched {len(matched)}, e.g. {matched[:3]}"
        linears = sorted(k.removesuffix(".weight") for k, shape in shapes.items()
                         if k.startswith(tuple(prefixes.values())) and k.endswith(".weight") and len(shape) == 2)
        raise LoraError(f"LoRA {lora.path}: {len(missing)} of {len(found)} module(s) match nothing in this model "
                        f"(e.g. {missing[:3]}); {what}; its linears are named like {linears[-2:]}")
    for path, key in found.items():
        layer, (rows, cols) = lora.layers[path], shapes[key]
        if layer.A.shape[1] != cols or layer.B.shape[0] != rows:
            raise LoraError(f"LoRA {lora.path}: {path}: lora_A {list(layer.A.shape)} / lora_B "
                            f"{list(layer.B.shape)} do not fit {key.removesuffix('.weight')} [{rows}, {cols}] "
                            f"(rank {layer.rank}: A must be [r, {cols}], B [{rows}, r])")
    return found


@dataclass
class ResidentLayer:
    """One adapter's pair on one module: per phase, this rank's (A, B) views, and s = alpha / r."""

    scale: float
    views: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ResidentAdapter:
    name: str
    path: str
    layers: dict[str, ResidentLayer]   # by module name in the model
    nbytes: int = 0


@dataclass
class _RowGroup:
    """The rows of one step's batch that carry adapter `name`: all rows at one weight (`index`
    None, `weight` a float), or the rows `index` each at its own weight ([n] tensor)."""

    name: str
    index: torch.Tensor | None
    weight: float | torch.Tensor


@dataclass
class ResidentLoras:
    """The adapters resident on one rank of a built model (`dtgen.build.Built`).

    `prefixes`: the model's name map (`ModelAdapter.lora_prefixes`): adapter-file path prefix ->
    checkpoint key prefix; a module path then names the checkpoint key `<prefix><rest>.weight`,
    and the parameter reading that key (the build's `ParamSpec.keys`) is the module's weight.
    `dtype`: what the pairs are stored in (the model dtype; an FP8 base takes them in this)."""

    built: object
    dtype: torch.dtype
    prefixes: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, ResidentAdapter] = field(default_factory=dict)
    default: RowAdapters = ()
    merged: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self):
        if not self.prefixes:
            self.prefixes = dict(getattr(self.built, "lora_prefixes", {}) or {})
        specs = self.built.storage.specs
        # checkpoint key -> the parameter that reads it (single-key weights only: a pair is per matrix)
        self._by_key = {spec.keys[0]: name for name, spec in specs.items()
                        if len(spec.keys) == 1 and spec.scale_of is None and name.endswith(".weight")
                        and len(spec.official_shape) == 2}
        self._modules = dict(self.built.model.named_modules())
        self._hooks: dict[str, object] = {}
        self._groups: list[_RowGroup] = []
        self._rows: int | None = None
        self._last: tuple | None = None
        self.set_rows(None)

    # ---- matching -------------------------------------------------------------------
    def match(self, lora: LoraFile, prefixes: dict[str, str] | None = None) -> dict[str, str]:
        """Module path in the file -> module of the model (`match_keys` on the build's weights,
        through `prefixes`, default the model's name map)."""
        specs = self.built.storage.specs
        shapes = {key: specs[param].official_shape for key, param in self._by_key.items()}
        return {path: self._by_key[key].removesuffix(".weight")
                for path, key in match_keys(lora, prefixes or self.prefixes, shapes).items()}

    # ---- loading --------------------------------------------------------------------
    def _shards(self, module: str, spec: ParamSpec, A: torch.Tensor, B: torch.Tensor):
        """This rank's (A, B) views per phase, split like `spec` (the base weight's)."""
        storage = self.built.storage
        topology = self.built.controller.topology
        device = next(iter(storage.tensors.values())).device
        a_spec, b_spec = pair_specs(spec, A.shape[0])
        reader = _TensorReader({"A": A.to(self.dtype), "B": B.to(self.dtype)})
        tensors = {k: load_resident(reader, s, storage.shard, self.dtype, device)
                   for k, s in (("A", a_spec), ("B", b_spec))}
        pair = ResidentStorage(tensors, {"A": a_spec, "B": b_spec}, storage.shard, 0)
        views = {}
        S = topology.resolved.storage_tp
        for phase, groups in topology.phases.items():
            micros, group = groups.layout.micros_per_rank, groups.layout.micro_group(topology.rank, S)
            a, b = pair.phase_view("A", micros, group), pair.phase_view("B", micros, group)
            views[phase] = (a, b.flatten(0, 1) if b_spec.micro_packed else b)
        return views, sum(t.numel() * t.element_size() for t in tensors.values())

    def _checked_pairs(self, lora: LoraFile, weight: float | None = None, prefixes: dict[str, str] | None = None):
        """(module, spec, layer) for every layer, every shape checked against its base weight."""
        if weight is not None and not math.isfinite(weight):
            raise LoraError(f"LoRA {lora.path}: weight {weight} is not finite")
        found = self.match(lora, prefixes)
        specs = self.built.storage.specs
        return [(found[path], specs[found[path] + ".weight"], layer) for path, layer in lora.layers.items()]

    def load(self, name: str, path: str | Path, prefixes: dict[str, str] | None = None) -> ResidentAdapter:
        """Read, check and shard adapter `path` as `name`. On any error nothing resident changes.
        `prefixes`: a name map other than the model's for this adapter (Wan2.2-A14B's low-noise
        expert: models.wan.model.LORA_PREFIXES_EXPERT_2, diffusers' `load_into_transformer_2`)."""
        if name in self.adapters:
            raise LoraError(f"LoRA name {name!r} is already loaded")
        lora = read_lora(path)
        layers = {}
        nbytes = 0
        for module, spec, layer in self._checked_pairs(lora, prefixes=prefixes):
            if module in layers:
                raise LoraError(f"LoRA {lora.path}: two of its entries target {module}")
            views, n = self._shards(module, spec, layer.A, layer.B)
            layers[module] = ResidentLayer(layer.scale, views)
            nbytes += n
        adapter = ResidentAdapter(name, str(path), layers, nbytes)
        self.adapters[name] = adapter   # commit: all checks passed
        for module in layers:
            self._hook(module)
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoraError(f"LoRA {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        self.default = tuple((n, w) for n, w in self.default if n != name)
        used = {m for a in self.adapters.values() for m in a.layers}
        for module in [m for m in self._hooks if m not in used]:
            self._hooks.pop(module).remove()
        self.set_rows(None)

    def merge(self, path: str | Path, weight: float = 1.0) -> None:
        """Fold adapter `path` at `weight` into the resident weights (W += w s B A, in float32, then
        the weight's dtype): refused on an FP8 weight. Every phase sees it (views of one tensor)."""
        lora = read_lora(path)
        pairs = self._checked_pairs(lora, weight)
        storage = self.built.storage
        names = [m + ".weight" for m, _, _ in pairs]
        fp8 = [n for n in names if storage.specs[n].fp8]
        if fp8:
            raise LoraError(f"--lora-merge: {len(fp8)} target weight(s) are FP8 (e.g. {fp8[0]}): folding would "
                            f"re-quantize them; apply the adapter unmerged (--lora) instead")
        for (module, spec, layer), name in zip(pairs, names):
            delta = (weight * layer.scale) * (layer.B.float() @ layer.A.float())
            resident = storage.tensors[name]
            shard = load_resident(_TensorReader({spec.keys[0]: delta}), spec, storage.shard, torch.float32,
                                  resident.device)
            resident.copy_((resident.float() + shard).to(resident.dtype))
        self.merged.append((str(path), weight))

    # ---- which rows carry what ------------------------------------------------------
    def check(self, adapters: RowAdapters) -> None:
        """One line for a name that is not loaded or a weight that is not finite (a request's
        `loras`, before any work)."""
        for name, weight in adapters:
            if name not in self.adapters:
                raise LoraError(f"LoRA {name!r} is not loaded; loaded: {sorted(self.adapters)}")
            if not math.isfinite(weight):
                raise LoraError(f"LoRA {name!r}: weight {weight} is not finite")

    def set_rows(self, rows: list[RowAdapters] | None) -> None:
        """The adapters of each batch row of the next evaluations (None: every row carries
        `default`). A row may carry none, one or several (their deltas add)."""
        for row in rows or ():
            self.check(row)
        key = None if rows is None else tuple(rows)
        if key == self._last and key is not None:
            return   # the same rows as the last call (every call of a step, most steps)
        self._last = key
        if rows is None:
            self._rows = None
            self._groups = [_RowGroup(n, None, float(w)) for n, w in self.default]
            return
        device = next(iter(self.built.storage.tensors.values())).device
        self._rows = len(rows)
        groups = []
        for name in dict.fromkeys(n for row in rows for n, _ in row):
            per = [(i, sum(w for n, w in row if n == name)) for i, row in enumerate(rows)
                   if any(n == name for n, _ in row)]
            if len(per) == len(rows) and len({w for _, w in per}) == 1:
                groups.append(_RowGroup(name, None, per[0][1]))
            else:
                groups.append(_RowGroup(name, torch.tensor([i for i, _ in per], device=device),
                                        torch.tensor([w for _, w in per], dtype=torch.float32, device=device)))
        self._groups = groups

    @contextmanager
    def picked_rows(self, picked: list[int]):
        """Inside: the evaluations run on the rows `picked` of the batch `set_rows` described (a
        step cache's first-block step that runs the later blocks on some rows only)."""
        saved = (self._groups, self._rows)
        if self._rows is not None and any(g.index is not None for g in self._groups):
            rows = self._last
            self._last = None
            self.set_rows([rows[i] for i in picked])
            self._last = None
        try:
            yield
        finally:
            self._groups, self._rows = saved
            self._last = None

    def set_default(self, adapters: RowAdapters) -> None:
        self.set_rows([tuple(adapters)])  # checks names and weights
        self.default = tuple(adapters)
        self.set_rows(None)

    # ---- application ----------------------------------------------------------------
    def _hook(self, module: str) -> None:
        if module not in self._hooks:
            # prepend: the delta joins the base output before any reduce hook of the controller
            self._hooks[module] = self._modules[module].register_forward_hook(partial(self._apply, module),
                                                                              prepend=True)

    def _apply(self, module: str, _mod, args, out: torch.Tensor) -> torch.Tensor:
        if not self._groups:
            return out
        x = args[0]
        phase = self.built.controller.active
        if self._rows is not None and any(g.index is not None for g in self._groups) and x.shape[0] != self._rows:
            raise LoraError(f"LoRA rows: {module} runs on {x.shape[0]} batch rows, but the rows' adapters were "
                            f"set for {self._rows}")
        for g in self._groups:
            layer = self.adapters[g.name].layers.get(module)
            if layer is None:
                continue
            a, b = layer.views[phase]
            if a.dtype != x.dtype:
                a, b = a.to(x.dtype), b.to(x.dtype)
            rows = x if g.index is None else x.index_select(0, g.index)
            delta = F.linear(F.linear(rows, a), b)
            if g.index is None:
                out = out + delta * (g.weight * layer.scale)
            else:
                w = (g.weight * layer.scale).to(delta.dtype).view(-1, *([1] * (delta.dim() - 1)))
                out = out.index_add(0, g.index, delta * w)
        return out

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

The module a pair's delta joins is the weight's own linear (`<module>.weight`), or, for a weight
its module multiplies itself (a micro-packed gate/up, say), the `dtgen.layers.linear.ProductSite`
its module names in `lora_sites` (weight attribute -> site child): the site is called with the
product's input and output, so a hook on it adds the delta where a linear's hook would.
A linear's weight takes a pair when the linear computes with its own forward; one that says it
does not (`lora_refused`: why, e.g. a router whose weight a fused kernel reads) and stacked
(routed expert) weights take none: an adapter that names one is refused in one line saying why.

Which adapters a row carries is set by the caller per step (`set_rows`, the denoise loop), or
`default` for every row: nothing about requests is baked into the modules. The pairs of every
adapter the rows carry are stacked along the rank (A [sum r, in], B [out, sum r]; one adapter's pair
as it is) when that set of adapters is set, and each targeted linear runs two GEMMs, each rank
column scaled per row by that row's weight of its adapter (0 where the row carries none; one row of
weights when every row carries the same): no gather or scatter per adapter. The hooks read only
tensors made then, from the module they run on (a plain attribute, never looked up by the module's
name), whose shapes change with the set's ranks alone: a compiled step, or one region compiled for
every block, is not compiled again per block, for another weight, or for other adapters of the
same ranks.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8 import FP8Linear
from ..layers.linear import Linear
from ..plan import Rule
from ..storage import ParamSpec, ResidentStorage, load_resident
from .files import LoraError, LoraFile, read_lora

# The modules whose weight a pair may target: linears that compute with their own forward.
_LINEARS = (nn.Linear, Linear, FP8Linear)

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


def match_keys(lora: LoraFile, prefixes: dict[str, str], shapes: dict[str, tuple[int, ...]],
               refused: dict[str, str] | None = None) -> dict[str, str]:
    """Module path in the file -> the checkpoint key of its base weight, through the model's name
    map `prefixes` (`ModelAdapter.lora_prefixes`); `shapes`: checkpoint key -> official shape.
    `refused`: checkpoint key -> why its weight takes no pair (routed experts, a fused router).
    One line for paths that match nothing (how many, a few, what the model's linears are named
    like), for a path that names a refused weight and for a pair whose shape does not fit its weight."""
    if not prefixes:
        raise LoraError(f"LoRA {lora.path}: this model declares no LoRA name map (ModelAdapter.lora_prefixes)")
    refused = refused or {}
    found = {p: _key_of(p, lora.prefixed, prefixes, shapes) for p in lora.layers}
    no_pair = sorted(p for p, k in found.items() if k in refused)
    if no_pair:
        raise LoraError(f"LoRA {lora.path}: {no_pair[0]} {refused[found[no_pair[0]]]}: it takes no LoRA pair "
                        f"({len(no_pair)} such module(s) in the adapter); leave them out of its targets")
    missing = sorted(p for p, k in found.items() if k is None)
    if missing:
        matched = sorted(p for p, k in found.items() if k is not None)
        what = "it looks like an adapter for another model" if not matched else \
            f"matched {len(matched)}, e.g. {matched[:3]}"
        linears = sorted(k.removesuffix(".weight") for k, shape in shapes.items()
                         if k.startswith(tuple(prefixes.values())) and k.endswith(".weight") and len(shape) == 2
                         and k not in refused)
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


@dataclass(frozen=True)
class _Rows:
    """The adapters the next evaluations' rows carry: `names` (every adapter some row carries) and
    `weights` [rows, len(names)], each row's weight of each (0 where it carries none); one row of
    weights when every row carries the same."""

    names: tuple[str, ...]
    weights: torch.Tensor


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
        self._modules = dict(self.built.model.named_modules())
        # the module each pair-taking weight's delta joins (single-key matrices: a pair is per matrix)
        self._site_of = {name: site for name, spec in specs.items()
                         if len(spec.keys) == 1 and not spec.stacked and spec.scale_of is None
                         and len(spec.official_shape) == 2 and (site := self._site(name)) is not None}
        self._by_key = {specs[name].keys[0]: name for name in self._site_of}   # checkpoint key -> parameter
        self._weight_of = {site: name for name, site in self._site_of.items()}   # module -> its weight
        # checkpoint key -> why its weight takes no pair
        self._refused = {k: "is a routed expert's weight, stacked with its layer's other experts"
                         for spec in specs.values() if spec.stacked for k in spec.keys}
        self._refused.update({spec.keys[0]: why for name, spec in specs.items() if len(spec.keys) == 1
                              and (why := getattr(self._modules.get(name.rpartition(".")[0]), "lora_refused", None))})
        self._hooks: dict[str, object] = {}
        # the attribute of each hooked module that holds this instance's pairs on it (`_publish`): one
        # name per instance, so two instances over one model keep theirs apart
        self._attr = f"lora_pairs_{id(self):x}"
        self._rows: _Rows | None = None            # None: no row carries an adapter
        # per (module, phase), for the adapters of `_rows` (`_stacked_names`): their pairs stacked
        # along the rank (A [sum r, in], B [out, sum r]); absent where none of them targets the
        # module; its layout of rank columns ((adapter index, rank, scale) per adapter), and per
        # layout each rank column's adapter index and scale
        self._stacked: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._layout_of: dict[tuple[str, str], tuple] = {}
        self._columns: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacked_names: tuple[str, ...] = ()
        # each set of adapters' stacks, as `_restack` made them (one adapter's are its own views), kept
        # until an adapter is loaded or unloaded
        self._sets: dict[tuple[str, ...], tuple] = {}
        # per layout of rank columns: each row's factor of each column (weight x scale): [rows,
        # sum r], or [sum r] when every row carries the same
        self._coef: dict[tuple, torch.Tensor] = {}
        # the factors' tensors per (set, rows), written in place when only the weights change: a
        # CUDA graph recorded over the hooks reads them where it was recorded (`graph_key`)
        self._coef_buffers: dict[tuple, dict[tuple, torch.Tensor]] = {}
        self._last: tuple | None = None
        # called after a load or an unload (the stacks above are made anew): whatever recorded them
        # drops its recordings (a pipeline's CUDA graphs, `CompiledSteps.reset_graphs`)
        self.on_change: list = []
        self.set_rows(None)

    def _site(self, param: str) -> str | None:
        """The module whose output a pair on `param` joins: `<module>.weight`'s module, or the
        site its module names for it in `lora_sites`; None for any other parameter."""
        owner, _, attr = param.rpartition(".")
        module = self._modules.get(owner)
        if attr == "weight" and isinstance(module, _LINEARS) and not getattr(module, "lora_refused", None):
            return owner
        site = getattr(self._modules.get(owner), "lora_sites", {}).get(attr)
        return f"{owner}.{site}" if site is not None else None

    # ---- matching -------------------------------------------------------------------
    def pair_targets(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every module a pair may target -> (its base weight's checkpoint key, that weight's
        official [out, in] shape): what an adapter for this model may name."""
        specs = self.built.storage.specs
        return {site: (specs[name].keys[0], specs[name].official_shape) for name, site in self._site_of.items()}

    def match(self, lora: LoraFile, prefixes: dict[str, str] | None = None) -> dict[str, str]:
        """Module path in the file -> module of the model (`match_keys` on the build's weights,
        through `prefixes`, default the model's name map)."""
        specs = self.built.storage.specs
        shapes = {key: specs[param].official_shape for key, param in self._by_key.items()}
        shapes.update({key: spec.official_shape for name, spec in specs.items() for key in spec.keys
                       if key in self._refused})
        found = match_keys(lora, prefixes or self.prefixes, shapes, self._refused)
        return {path: self._site_of[self._by_key[key]] for path, key in found.items()}

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
        return [(found[path], specs[self._weight_of[found[path]]], layer) for path, layer in lora.layers.items()]

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
        self.adapters[name] = adapter   # commit: all checks passed (no row carries it yet)
        self._sets.clear()   # their stacks hold no hook of the new modules
        self._coef_buffers.clear()
        for module in layers:
            self._hook(module)
        for changed in self.on_change:
            changed()
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoraError(f"LoRA {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        self.default = tuple((n, w) for n, w in self.default if n != name)
        used = {m for a in self.adapters.values() for m in a.layers}
        for module in [m for m in self._hooks if m not in used]:
            self._hooks.pop(module).remove()
            delattr(self._modules[module], self._attr)
        self._stacked, self._layout_of, self._columns, self._stacked_names = {}, {}, {}, ()
        self._sets, self._coef, self._coef_buffers, self._last = {}, {}, {}, None
        self._publish()
        self.set_rows(None)
        for changed in self.on_change:
            changed()

    def merge(self, path: str | Path, weight: float = 1.0) -> None:
        """Fold adapter `path` at `weight` into the resident weights (W += w s B A, in float32, then
        the weight's dtype): refused on an FP8 weight. Every phase sees it (views of one tensor)."""
        lora = read_lora(path)
        pairs = self._checked_pairs(lora, weight)
        storage = self.built.storage
        names = [self._weight_of[m] for m, _, _ in pairs]
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
        key = None if rows is None else tuple(tuple((n, float(w)) for n, w in row) for row in rows)
        if key == self._last and key is not None:
            return   # the same rows as the last call (every call of a step, most steps)
        self._last = key
        if rows is None or len(set(key)) == 1:   # every row alike: one row of weights
            key = (tuple((n, float(w)) for n, w in self.default) if rows is None else key[0],)
        names = tuple(sorted({n for row in key for n, _ in row}))   # the same set in any order: one stack
        if not names:
            self._rows, self._coef = None, {}
            return
        weights = torch.zeros(len(key), len(names))
        for i, row in enumerate(key):
            for n, w in row:
                weights[i, names.index(n)] += w
        device = next(iter(self.built.storage.tensors.values())).device
        self._rows = _Rows(names, weights.to(device))
        if names != self._stacked_names:
            # each set's stacks are kept (one adapter's are its own views, no copy), so switching
            # among resident adapters rebuilds nothing
            if names in self._sets:
                self._stacked, self._layout_of, self._columns, published = self._sets[names]
                self._stacked_names = names
                self._publish(published)
            else:
                self._restack(names)
                self._sets[names] = (self._stacked, self._layout_of, self._columns, self._publish())
        coef = self._coefs(self._rows.weights)
        buffers = self._coef_buffers.setdefault((names, len(key)), coef)
        if buffers is not coef:
            for layout, values in coef.items():
                buffers[layout].copy_(values)
        self._coef = buffers

    def graph_key(self) -> tuple | None:
        """What a CUDA graph recorded over the hooks bakes in from here (`GraphedStep.state`): the
        set of adapters the rows carry and how many rows of factors (their stacks and factors'
        tensors are kept per such key, the factors written in place for new weights). A load or an
        unload makes the stacks anew and drops every recording (`on_change`)."""
        return None if self._rows is None else (self._stacked_names, self._rows.weights.shape[0])

    def _publish(self, published: dict[str, dict] | None = None) -> dict[str, dict]:
        """Each hooked module's pairs (its attribute `_attr`): per phase, its stacked pair and layout
        of rank columns (`published`: made before for the same stacks). The hook reads them from the
        module it runs on, never by the module's name: the blocks of a model then trace alike, so a
        region compiled once for every block is not compiled again per block."""
        if published is None:
            phases = self.built.controller.topology.phases
            published = {module: {phase: (*self._stacked[(module, phase)], self._layout_of[(module, phase)])
                                  for phase in phases if (module, phase) in self._stacked} for module in self._hooks}
        for module, pairs in published.items():
            self._modules[module].__dict__[self._attr] = pairs   # a plain attribute: no parameter or buffer
        return published

    def _restack(self, names: tuple[str, ...]) -> None:
        """The stacked pairs of `names` on every hooked module and phase (phases whose views are
        the same tensors share one stack), and each stack's rank columns (adapter, scale)."""
        made: dict[tuple, tuple] = {}
        self._stacked, self._layout_of, self._columns = {}, {}, {}
        for module in self._hooks:
            found = [(k, self.adapters[n].layers[module]) for k, n in enumerate(names)
                     if module in self.adapters[n].layers]
            if not found:
                continue
            layout = tuple((k, layer.views[next(iter(layer.views))][0].shape[0], layer.scale) for k, layer in found)
            for phase in self.built.controller.topology.phases:
                pairs = [layer.views[phase] for _, layer in found]
                same = tuple((t.data_ptr(), tuple(t.shape)) for pair in pairs for t in pair)
                if same not in made:
                    made[same] = ((pairs[0][0], pairs[0][1]) if len(pairs) == 1 else
                                  (torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs], dim=1)))
                self._stacked[(module, phase)] = made[same]
                self._layout_of[(module, phase)] = layout
                if layout not in self._columns:
                    a = made[same][0]
                    self._columns[layout] = (
                        torch.cat([torch.full((r,), k) for k, r, _ in layout]).to(a.device),
                        torch.cat([torch.full((r,), scale) for _, r, scale in layout]).to(a.device))
        self._stacked_names = names

    def _coefs(self, weights: torch.Tensor) -> dict[tuple, torch.Tensor]:
        """Per layout of rank columns, each row's factor of each column (weight x scale): [rows,
        sum r], or [sum r] for one row of weights (every row alike: broadcast over any leading
        dims, a decode step's one token too)."""
        rows = weights[0] if weights.shape[0] == 1 else weights
        return {layout: (rows[..., adapter] * scale).to(self.dtype)   # in float32, then the pairs' dtype
                for layout, (adapter, scale) in self._columns.items()}

    @contextmanager
    def picked_rows(self, picked: list[int]):
        """Inside: the evaluations run on the rows `picked` of the batch `set_rows` described (a
        step cache's first-block step that runs the later blocks on some rows only)."""
        saved = (self._rows, self._coef, self._last)
        if self._rows is not None and self._rows.weights.shape[0] > 1:
            index = torch.tensor(picked, device=self._rows.weights.device)
            self._rows = _Rows(self._rows.names, self._rows.weights[index])
            self._coef = self._coefs(self._rows.weights)
        try:
            yield
        finally:
            self._rows, self._coef, self._last = saved

    def set_default(self, adapters: RowAdapters) -> None:
        self.set_rows([tuple(adapters)])  # checks names and weights
        self.default = tuple(adapters)
        self.set_rows(None)

    # ---- application ----------------------------------------------------------------
    def _hook(self, module: str) -> None:
        if module not in self._hooks:
            # prepend: the delta joins the base output before any reduce hook of the controller
            setattr(self._modules[module], self._attr, {})
            self._hooks[module] = self._modules[module].register_forward_hook(self._apply, prepend=True)

    def _apply(self, mod: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        if self._rows is None:
            return out
        pair = getattr(mod, self._attr).get(self.built.controller.active)
        if pair is None:   # none of the rows' adapters targets this module
            return out
        # every adapter of every row in two GEMMs over the stacked rank, each rank column scaled per
        # row by that row's weight of its adapter (0: the row does not carry it)
        x, (a, b, layout) = args[0], pair
        coef = self._coef[layout]
        z = F.linear(x, a.to(x.dtype))
        if coef.dim() == 2:   # rows carrying different adapters: a factor per row
            if coef.shape[0] != x.shape[0]:
                raise LoraError(f"LoRA rows: a targeted linear runs on {x.shape[0]} batch rows, but the rows' "
                                f"adapters were set for {coef.shape[0]}")
            coef = coef.view(coef.shape[0], *([1] * (z.dim() - 2)), -1)
        return out + F.linear(z * coef.to(x.dtype), b.to(x.dtype))

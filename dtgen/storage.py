"""Resident storage: each rank's one copy of its weight shard, packed micro-major.

For storage TP degree S and `n` micros per storage shard, the finest split has S*n blocks;
storage shard s holds blocks s*n .. s*n+n-1, packed so that any run of consecutive micros
is a view:
- COLUMN / COLUMN_KV_GROUPS / VOCAB: rows, block after block (contiguous views);
- ROW: columns, block after block (a strided view; fine for a matmul);
- PAIR and expert stacks (`micro_packed` parameters): a leading micro dim, [n, ...], where
  a fused gate/up micro is [x1 block; x2 block] (so [h1_m0, h2_m0, h1_m1, h2_m1]).
Only the bytes of the shard are read from the checkpoint.

FP8 weights (`ParamSpec.fp8`): read in the checkpoint's dtype, quantized to e4m3 on the
device as they arrive (`kernels.fp8_quant`) and stored with their scales, a second resident
tensor (a spec with `scale_of` set): one resident copy, FP8 plus scales. The scales belong
to the official matrices, so every plan quantizes a weight alike:
- "channels": one scale per official row. Rows split by TP (gate/up) keep theirs, packed
  like the weight; rows whose columns are split (down) take the max over all ranks' blocks
  (`reduce_max`, one all-reduce per weight), a replicated [E, H].
- "blocks": one per 128 x 128 block of the official matrix, packed like the weight; a TP
  split must not cut a block (`check_fp8_split`).
- "tensor": one per official matrix (per expert), the max over every rank's block
  (`reduce_max`, one all-reduce per weight), held in the channels layout (every row holds
  its matrix's scale) so that the kernels run their channel path.
Dense FP8 linears (not stacked; `dtgen.fp8.FP8Linear`, HunyuanImage's shared MLP) are
"channels" only: a weight [N, K] has scales [N], split like its rows under COLUMN /
COLUMN_KV_GROUPS (packed like them when micro-packed) and replicated under ROW (each the
max over every rank's columns, `reduce_max`), so every plan quantizes a weight alike.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, FP8_RECIPES, GROUP, expert_amax, quantize_weight_blocks,
                               quantize_weight_channels, quantize_weight_per_expert, scale_from_amax)

from .checkpoint import CheckpointError, CheckpointReader
from .plan import PlanError, Rule

_SPLIT_RULES = (Rule.COLUMN, Rule.COLUMN_KV_GROUPS, Rule.VOCAB, Rule.PAIR, Rule.ROW)


@dataclass(frozen=True)
class StorageShard:
    """Which storage shard this rank holds."""

    storage_tp: int   # S
    index: int        # s
    num_micros: int   # n

    @property
    def pieces(self) -> int:
        return self.storage_tp * self.num_micros


@dataclass(frozen=True)
class ParamSpec:
    """What the storage needs to know about one parameter."""

    keys: tuple[str, ...]      # official checkpoint tensors
    rule: Rule
    official_shape: tuple[int, ...]
    stacked: bool = False      # keys are per-expert tensors stacked on a new dim
    micro_packed: bool = False  # leading micro dim in our layout
    unit: int = 1              # indivisible block along the split dim (rows of one KV group)
    unit_name: str = "rows"
    dtype: torch.dtype | None = None  # None: the model dtype
    fp8: str | None = None     # one of FP8_RECIPES: an e4m3 weight, or (with scale_of) its scales
    scale_of: "ParamSpec | None" = None  # for a scale tensor: its weight's spec (no checkpoint keys)


def _split_dim(spec: ParamSpec) -> int | None:
    if spec.rule == Rule.REPLICATE:
        return None
    return len(spec.official_shape) - 1 if spec.rule == Rule.ROW else 0


def check_divisible(name: str, spec: ParamSpec, pieces: int) -> None:
    """A split dim must hold a whole number of units per finest block (and PAIR halves alike)."""
    dim = _split_dim(spec)
    if dim is None:
        return
    size = spec.official_shape[dim]
    if spec.rule == Rule.PAIR:
        if size % 2:
            raise PlanError(f"{name}: fused gate/up rows {size} are odd; cannot split into [x1; x2]")
        size //= 2
    units = size // spec.unit
    if size % spec.unit or units % pieces:
        raise PlanError(f"{name}: {units} {spec.unit_name} along dim {dim} (size {spec.official_shape[dim]}"
                        f"{', per half' if spec.rule == Rule.PAIR else ''}) are not divisible by the finest TP "
                        f"split of {pieces} (storage TP x micros)")


_CHANNEL_LAYOUT = ("channels", "tensor")  # recipes whose scales are one per official row


def scale_spec(weight: ParamSpec) -> ParamSpec:
    """The spec of an FP8 weight's scales (float32, not in the checkpoint): packed and placed
    like the weight, except the per-row scales of a column-split weight (replicated)."""
    if weight.fp8 not in FP8_RECIPES:
        raise ValueError(f"FP8 scales exist for FP8 weights, recipe one of {FP8_RECIPES}; got fp8={weight.fp8!r}")
    if not weight.micro_packed and (weight.fp8 != "channels" or len(weight.official_shape) != 2):
        raise ValueError(f"FP8 scales of a dense (not micro-packed) weight are per channel, of a 2-D matrix; got "
                         f"fp8={weight.fp8!r}, official shape {weight.official_shape}")
    if weight.fp8 in _CHANNEL_LAYOUT and weight.rule == Rule.ROW:
        rows = weight.official_shape[0]
        return ParamSpec(keys=(), rule=Rule.REPLICATE,
                         official_shape=(len(weight.keys), rows) if weight.stacked else (rows,),
                         dtype=torch.float32, fp8=weight.fp8, scale_of=weight)
    if not weight.micro_packed:  # a dense [N, K] matrix: scales [N], split like its rows (or replicated)
        return ParamSpec(keys=(), rule=weight.rule, official_shape=weight.official_shape[:1], unit=weight.unit,
                         unit_name=weight.unit_name, dtype=torch.float32, fp8=weight.fp8, scale_of=weight)
    return ParamSpec(keys=(), rule=weight.rule, official_shape=weight.official_shape, stacked=weight.stacked,
                     micro_packed=True, unit=weight.unit, unit_name=weight.unit_name, dtype=torch.float32,
                     fp8=weight.fp8, scale_of=weight)


def check_fp8_split(name: str, spec: ParamSpec, pieces: int) -> None:
    """Block scales belong to the official 128 x 128 grid: a TP split must fall on it."""
    if spec.fp8 != "blocks" or spec.scale_of is not None or pieces == 1:
        return
    dim = _split_dim(spec)
    size = spec.official_shape[dim] // (2 if spec.rule == Rule.PAIR else 1)
    if size % (pieces * GROUP):
        raise PlanError(f"{name}: FP8 block scales are {GROUP}x{GROUP} blocks of the official matrix, but the "
                        f"finest TP split of {pieces} (storage TP x micros) cuts its {size} "
                        f"{'rows per half' if spec.rule == Rule.PAIR else 'columns'} into {size / pieces:g}, not "
                        f"a multiple of {GROUP}: use --fp8-scales channels, or a plan with fewer pieces")


def _scale_shape(recipe: str, rows: int, cols: int) -> tuple[int, ...]:
    return (rows,) if recipe in _CHANNEL_LAYOUT else (-(-rows // GROUP), -(-cols // GROUP))


def _quantize_block(recipe: str, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weight_channels(block) if recipe == "channels" else quantize_weight_blocks(block)


def resident_shape(spec: ParamSpec, shard: StorageShard) -> tuple[int, ...]:
    if spec.scale_of is not None and spec.rule == Rule.REPLICATE:
        return spec.official_shape
    if spec.scale_of is not None:  # [n, (E,) rows, cols] of the weight -> its scales' grid
        *lead, rows, cols = resident_shape(spec.scale_of, shard)
        return tuple(lead) + _scale_shape(spec.fp8, rows, cols)
    shape = list(spec.official_shape)
    dim = _split_dim(spec)
    n, P = shard.num_micros, shard.pieces
    if dim is None:
        return tuple(shape)
    if spec.micro_packed:
        shape[dim] //= P
        inner = ([len(spec.keys)] if spec.stacked else []) + shape
        return tuple([n] + inner)
    shape[dim] //= shard.storage_tp
    return tuple(shape)


def planned_nbytes(specs: dict[str, ParamSpec], shard: StorageShard, dtype: torch.dtype) -> int:
    """Bytes this rank's resident storage will hold, known before any byte is allocated."""
    total = 0
    for spec in specs.values():
        numel = 1
        for d in resident_shape(spec, shard):
            numel *= d
        total += numel * (spec.dtype or dtype).itemsize
    return total


@dataclass(frozen=True)
class Fp8Alternative:
    """What the same plan's weights would take with the stacked (expert) weights in e4m3:
    `expert_bytes` in e4m3, `scale_bytes` of their per-row float32 scales, `total_bytes` with
    every other weight as it is."""

    total_bytes: int
    expert_bytes: int
    scale_bytes: int
    flag: str = "--moe-dtype fp8"


def fp8_alternative(specs: dict[str, ParamSpec], shard: StorageShard, dtype: torch.dtype,
                    flag: str = "--moe-dtype fp8") -> Fp8Alternative | None:
    """The bytes of `specs` with their stacked weights stored in e4m3 and per-row scales
    ("channels", the default recipe), or None when none is stacked or they already are FP8.
    Exactly what `planned_nbytes` gives for the same model built for FP8 experts."""
    stacked = {n: s for n, s in specs.items() if s.stacked and s.fp8 is None and s.micro_packed}
    if not stacked or any(s.fp8 is not None for s in specs.values()):
        return None
    quantized = {n: replace(s, dtype=FP8_DTYPE, fp8="channels") for n, s in stacked.items()}
    expert = planned_nbytes(quantized, shard, dtype)
    scales = planned_nbytes({n: scale_spec(s) for n, s in quantized.items()}, shard, dtype)
    return Fp8Alternative(planned_nbytes(specs, shard, dtype) - planned_nbytes(stacked, shard, dtype) + expert + scales,
                          expert, scales, flag)


def fit_problem(weight_bytes: int, device_type: str, plan_name: str, reserve_bytes: int = 0,
                budget_bytes: int | None = None, free_bytes: int | None = None, total_bytes: int | None = None,
                alternative: Fp8Alternative | None = None, dtype: torch.dtype | None = None) -> str | None:
    """Why this rank's weights (plus a working reserve) cannot fit, as one line, or None.
    The room is the device's free memory (`free_bytes`, CUDA) and, when given, the memory
    budget (`budget_bytes`, any device); the CPU without a budget is not checked (the OS
    decides). The refusal says what FP8 experts would take (`alternative`), and whether that fits."""
    rooms = []
    if budget_bytes is not None:
        rooms.append((budget_bytes, f"the memory budget (--memory-budget) is {_size(budget_bytes)}"))
    if free_bytes is not None:
        rooms.append((free_bytes, f"{device_type} has {_size(free_bytes)} free of {_size(total_bytes or free_bytes)}"))
    if not rooms:
        return None
    room, why = min(rooms, key=lambda r: r[0])
    if weight_bytes + reserve_bytes <= room:
        return None
    what = f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
    text = (f"plan '{plan_name}' needs {weight_bytes:,} bytes ({_size(weight_bytes)}) of weights per rank{what}, "
            f"plus a {_size(reserve_bytes)} working reserve, but {why}: ")
    if alternative is not None:
        fits = alternative.total_bytes + reserve_bytes <= room
        text += (f"with {alternative.flag} they would take {alternative.total_bytes:,} bytes "
                 f"({_size(alternative.total_bytes)}: the experts {_size(alternative.expert_bytes)} in e4m3 + "
                 f"{_size(alternative.scale_bytes)} of scales), which " + ("fits: add " + alternative.flag + ", or "
                 if fits else "does not fit either; ") + "use")
    else:
        text += "use"
    return text + " a plan with a larger storage TP degree (more ranks share each weight)"


def check_fits(weight_bytes: int, device: torch.device, plan_name: str, reserve_bytes: int = 0,
               budget_bytes: int | None = None, alternative: Fp8Alternative | None = None,
               dtype: torch.dtype | None = None) -> None:
    """Raise MemoryError, before loading, when this rank's weights (plus a working reserve)
    cannot fit the device's free memory or the memory budget (`fit_problem`)."""
    free = total = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    problem = fit_problem(weight_bytes, str(device), plan_name, reserve_bytes, budget_bytes, free, total,
                          alternative, dtype)
    if problem is not None:
        raise MemoryError(problem)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _read_block(reader: CheckpointReader, key: str, spec: ParamSpec, block: int, blocks: int) -> torch.Tensor:
    """Block `block` of `blocks` along the split dim of one official tensor."""
    dim = _split_dim(spec)
    size = spec.official_shape[dim]
    if spec.rule == Rule.PAIR:
        half = size // 2
        step = half // blocks
        x1 = reader.read(key, dim, block * step, (block + 1) * step)
        x2 = reader.read(key, dim, half + block * step, half + (block + 1) * step)
        return torch.cat([x1, x2], dim=dim)
    step = size // blocks
    return reader.read(key, dim, block * step, (block + 1) * step)


def _quantize_resident(spec: ParamSpec, raw: torch.Tensor, shard: StorageShard,
                       reduce_max: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A resident weight [n, E, rows, cols] (a micro-packed stack), [n, rows, cols] (a
    micro-packed dense pair) or [rows, cols] (a dense matrix) in a float dtype -> (e4m3,
    its scales)."""
    if spec.fp8 == "tensor":  # per official matrix: the max over its micros, rows and every rank's block
        if not spec.stacked:
            raise ValueError(f"FP8 recipe 'tensor' needs stacked expert weights (keys {spec.keys[:2]}...)")
        amax = expert_amax(raw)
        amax = reduce_max(amax) if reduce_max else amax  # tensor scales are global, like the official matrix
        return quantize_weight_per_expert(raw, resident_shape(scale_spec(spec), shard), amax)
    if spec.fp8 == "channels" and spec.rule == Rule.ROW:  # per official row: the max over every rank's columns
        amax = raw.abs().amax(dim=-1).float()
        if spec.micro_packed:  # [n, E, rows]: the max over this rank's micros too
            amax = amax.amax(dim=0)
        if not spec.micro_packed:  # a dense [rows, cols]: no micro dim
            scale = scale_from_amax(reduce_max(amax) if reduce_max else amax)
            return (raw.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
        scale = scale_from_amax(reduce_max(amax) if reduce_max else amax)
        q = torch.empty(raw.shape, dtype=FP8_DTYPE, device=raw.device)
        for j in range(raw.shape[0]):  # a micro at a time: one float32 temporary of a micro's size
            q[j] = (raw[j].float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale
    q = torch.empty(raw.shape, dtype=FP8_DTYPE, device=raw.device)
    scale = torch.empty(resident_shape(scale_spec(spec), shard), dtype=torch.float32, device=raw.device)
    for index in itertools.product(*(range(d) for d in raw.shape[:-2])):
        q[index], scale[index] = _quantize_block(spec.fp8, raw[index])
    return q, scale


def load_resident(reader: CheckpointReader, spec: ParamSpec, shard: StorageShard, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Allocate this rank's resident tensor once and fill it slice by slice."""
    out = torch.empty(resident_shape(spec, shard), dtype=dtype, device=device)
    dim = _split_dim(spec)
    if dim is None:
        out.copy_(reader.read(spec.keys[0]))
    elif spec.micro_packed:
        for j in range(shard.num_micros):
            block = shard.index * shard.num_micros + j
            for e, key in enumerate(spec.keys):
                target = out[j, e] if spec.stacked else out[j]
                target.copy_(_read_block(reader, key, spec, block, shard.pieces))
    else:
        out.copy_(_read_block(reader, spec.keys[0], spec, shard.index, shard.storage_tp))
    return out


def validate_checkpoint(reader: CheckpointReader, specs: dict[str, ParamSpec],
                        ignored_prefixes: tuple[str, ...] = ()) -> None:
    """Missing keys, unexpected keys and shape mismatches, each listed by name."""
    expected = {k: (name, spec) for name, spec in specs.items() for k in spec.keys}
    present = reader.keys()
    missing = sorted(set(expected) - present)
    unexpected = sorted(k for k in present - set(expected) if not k.startswith(ignored_prefixes))
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing[:20]}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected[:20]}"
                        + (" ..." if len(unexpected) > 20 else ""))
    for key in sorted(set(expected) & present):
        want = expected[key][1].official_shape
        found = reader.info(key).shape
        if tuple(found) != tuple(want):
            problems.append(f"shape mismatch for {key}: expected {list(want)}, found {list(found)}")
    if problems:
        raise CheckpointError(f"checkpoint {reader.directory} does not match the model config:\n  "
                              + "\n  ".join(problems))


def _scale_names(specs: dict[str, ParamSpec]) -> dict[str, str]:
    """FP8 weight name -> its scales' name; every FP8 weight must have one."""
    by_spec = {id(spec.scale_of): name for name, spec in specs.items() if spec.scale_of is not None}
    names = {}
    for name, spec in specs.items():
        if spec.fp8 and spec.scale_of is None:
            if id(spec) not in by_spec:
                raise ValueError(f"FP8 weight {name} has no scale spec (make one with scale_spec)")
            names[name] = by_spec[id(spec)]
    return names


class ResidentStorage:
    """The bytes this rank owns: one tensor per parameter, never reallocated."""

    def __init__(self, tensors: dict[str, torch.Tensor], specs: dict[str, ParamSpec], shard: StorageShard,
                 bytes_read: int):
        self.tensors = tensors
        self.specs = specs
        self.shard = shard
        self.bytes_read = bytes_read

    @classmethod
    def load(cls, reader: CheckpointReader, specs: dict[str, ParamSpec], shard: StorageShard,
             dtype: torch.dtype, device: torch.device | str = "cpu",
             progress: Callable[[str], None] | None = None,
             reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "ResidentStorage":
        """reduce_max: the elementwise max of a tensor over all ranks (FP8 channel scales of
        column-split weights); None on one rank."""
        for name, spec in specs.items():
            check_divisible(name, spec, shard.pieces)
            check_fp8_split(name, spec, shard.pieces)
        scale_names = _scale_names(specs)
        start = reader.bytes_read
        tensors = {}
        for name, spec in specs.items():
            if spec.scale_of is not None:
                continue  # filled with its weight
            if progress:
                progress(name)
            if spec.fp8:  # read in the model dtype (exact for a bf16 checkpoint), one weight at a time
                raw = load_resident(reader, spec, shard, dtype, torch.device(device))
                tensors[name], tensors[scale_names[name]] = _quantize_resident(spec, raw, shard, reduce_max)
                del raw
            else:
                tensors[name] = load_resident(reader, spec, shard, spec.dtype or dtype, torch.device(device))
        return cls({name: tensors[name] for name in specs}, specs, shard, reader.bytes_read - start)

    @classmethod
    def random(cls, specs: dict[str, ParamSpec], shard: StorageShard, dtype: torch.dtype,
               device: torch.device | str = "cpu", seed: int = 0,
               reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "ResidentStorage":
        """Random weights created directly in this rank's packed layout (no checkpoint).

        For speed and memory runs where no checkpoint is at hand: N(0, 0.02) for matrices,
        1 + N(0, 0.02) for 1-D scales, generated on the device.
        """
        for name, spec in specs.items():
            check_divisible(name, spec, shard.pieces)
            check_fp8_split(name, spec, shard.pieces)
        g = torch.Generator(device=device).manual_seed(seed * 1000 + shard.index)
        scale_names = _scale_names(specs)
        tensors = {}
        for name, spec in specs.items():
            if spec.scale_of is not None:
                continue  # made with its weight
            t = torch.randn(resident_shape(spec, shard), generator=g, device=device,
                            dtype=dtype if spec.fp8 else (spec.dtype or dtype))
            t.mul_(0.02)
            if t.dim() == 1 and name.endswith("weight"):
                t.add_(1.0)
            if spec.fp8:  # quantized as a checkpoint load would
                tensors[name], tensors[scale_names[name]] = _quantize_resident(spec, t, shard, reduce_max)
            else:
                tensors[name] = t
        return cls({name: tensors[name] for name in specs}, specs, shard, 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def checkpoint_bytes(self, reader: CheckpointReader) -> int:
        """Size of this shard in the checkpoint's own dtypes (what reading it must cost)."""
        total = 0
        for name, t in self.tensors.items():
            if self.specs[name].scale_of is None:  # scales are made at load, not read
                total += t.numel() * reader.info(self.specs[name].keys[0]).dtype.itemsize
        return total

    def phase_view(self, name: str, micros: int, group: int) -> torch.Tensor:
        """The view of resident tensor `name` that a phase using `micros` micros (block `group`) computes with."""
        t = self.tensors[name]
        spec = self.specs[name]
        dim = _split_dim(spec)
        if dim is None or micros == self.shard.num_micros:
            return t
        if spec.micro_packed:
            return t[group * micros:(group + 1) * micros]
        per_micro = t.shape[dim] // self.shard.num_micros
        return t.narrow(dim, group * micros * per_micro, micros * per_micro)

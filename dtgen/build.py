"""The build: a model's modules on meta, a plan, a checkpoint -> resident weights and a phase controller.

A model gives a `ModelAdapter` (build on meta, where each parameter comes from, its attention
modules and their heads, dtype rules, the checkpoint keys it never reads); `build` does the
rest, in an order that fails early and leaves nothing half-made:

1. resolve the plan for the world size (`dtgen.plan.resolve`);
2. build the module tree on the meta device, match every parameter to a plan rule and every
   module output to an output layout;
3. check the plan against the model: heads per rank for the attention kinds
   (`dtgen.sp.check_heads`), divisibility of every split, FP8 block splits, and that the
   storage shard fits the device; all before any process group exists or any byte is read;
4. make the process groups (`Topology`), then read this rank's storage shard (or make a
   random one) into `ResidentStorage`;
5. wait for every rank, build the `PhaseController` and bind the plan's first phase.

Nothing here knows a model: HunyuanImage-3 and Wan are two adapters.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from kernels.fp8_quant import FP8_DTYPE

from .checkpoint import CheckpointReader
from .controller import PhaseController
from .fp8 import (check_attention_dtype, check_dense_dtype, fp8_linear_names, swap_fp8_linears,
                  use_fp8_attention)
from .plan import Output, Plan, PlanError, ResolvedPlan, Rule, match_outputs, match_rules, resolve
from .sp import check_heads
from .storage import (ParamSpec, ResidentStorage, StorageShard, check_divisible, check_fits, check_fp8_split,
                      fit_problem, fp8_alternative, planned_nbytes, scale_spec, validate_checkpoint)
from .topology import Topology


@dataclass(frozen=True)
class ParamSource:
    """Where a parameter's values live in the checkpoint.

    keys: one checkpoint tensor, or one per expert for parameters stacked over experts.
    stacked: the parameter holds the `keys` tensors stacked along a new expert dim (with FP8
        storage, stacked weights are the ones stored in e4m3).
    micro_packed: the parameter has a leading micro-pack dim (gate/up pairs, stacked experts).
    scale_of: FP8 scales: not in the checkpoint, made at load from this weight.
    """

    keys: tuple[str, ...]
    stacked: bool = False
    micro_packed: bool = False
    scale_of: str | None = None


class ModelAdapter:
    """What a model gives the build. The defaults fit a model whose parameter names are its
    checkpoint keys, stored in the build dtype, with no split needing more than one row."""

    # Checkpoint key prefixes the model never reads (they may be present).
    ignored_prefixes: tuple[str, ...] = ()

    def build_on_meta(self) -> nn.Module:
        """The whole module tree, built under `torch.device("meta")` by the caller."""
        raise NotImplementedError

    def attention_heads(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """The attention modules whose `core` the phases swap: name -> (query heads, KV heads)
        of the whole model."""
        raise NotImplementedError

    def param_sources(self, model: nn.Module) -> dict[str, ParamSource]:
        return {name: ParamSource((name,)) for name, _ in model.named_parameters()}

    def fp8_linears(self, model: nn.Module) -> list[str]:
        """Globs of the linears `build(dense_dtype="fp8")` stores in e4m3 (none: no such option)."""
        return []

    def fp8_attentions(self, model: nn.Module) -> tuple[list[nn.Module], int]:
        """(the attention modules `build(attention_dtype="fp8")` runs on FP8 attention, their
        head size); none: no such option."""
        return [], 0

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def split_unit(self, name: str, rule: Rule) -> tuple[int, str] | None:
        """(rows per split unit, what they are called) when a split must keep whole groups of
        rows together (e.g. a fused QKV's KV-head groups), else None."""
        return None

    def unbuilt_modules(self, model: nn.Module) -> tuple[str, ...]:
        """Name prefixes of modules this instance was built without (a plan's rules for them
        match nothing here)."""
        return ()

    def lora_prefixes(self, model: nn.Module) -> dict[str, str]:
        """The LoRA name map (dtgen/lora): an adapter file's module-path prefix -> the checkpoint
        key prefix it stands for ("" keys a PEFT folder's unprefixed paths). A path then names
        the checkpoint key `<prefix><rest>.weight`, and the parameter that reads that key (its
        `ParamSource`) is the module an adapter pair targets. Empty: no adapters."""
        return {}


def official_shape(meta_shape: torch.Size, stacked: bool, micro_packed: bool) -> tuple[int, ...]:
    shape = list(meta_shape)
    if micro_packed:
        shape = shape[1:]   # the micro dim (1 in the unsharded layout)
    if stacked:
        shape = shape[1:]   # the expert dim
    return tuple(shape)


def param_sources(adapter: ModelAdapter, model: nn.Module) -> dict[str, ParamSource]:
    """The adapter's sources, plus the scales of every `FP8Linear` (made at load from its
    weight; a model needs to say nothing about them)."""
    sources = adapter.param_sources(model)
    for prefix in fp8_linear_names(model):
        sources[f"{prefix}.weight_scale"] = ParamSource((), scale_of=f"{prefix}.weight")
    return sources


def param_specs(adapter: ModelAdapter, model: nn.Module, rules: dict[str, Rule], dtype: torch.dtype,
                fp8: str | None = None) -> dict[str, ParamSpec]:
    """The storage's view of every parameter. A weight that a scale parameter names
    (`ParamSource.scale_of`) is stored in e4m3: stacked (expert) weights in recipe `fp8`,
    dense ones per channel; every other weight in its dtype (`dtype`, or the adapter's)."""
    specs = {}
    sources = param_sources(adapter, model)
    scaled = {src.scale_of for src in sources.values() if src.scale_of is not None}
    for name, p in model.named_parameters():
        src = sources[name]
        if src.scale_of is not None:
            continue
        rule = rules[name]
        unit = adapter.split_unit(name, rule)
        recipe = (fp8 if src.stacked else "channels") if name in scaled else None
        if name in scaled and recipe is None:
            raise ValueError(f"{name}: FP8 stacked weights need a recipe (fp8=one of the FP8 recipes)")
        specs[name] = ParamSpec(
            keys=src.keys, rule=rule, official_shape=official_shape(p.shape, src.stacked, src.micro_packed),
            stacked=src.stacked, micro_packed=src.micro_packed, unit=unit[0] if unit else 1,
            unit_name=unit[1] if unit else ("columns" if rule == Rule.ROW else "rows"),
            dtype=FP8_DTYPE if recipe else adapter.param_dtype(name, dtype), fp8=recipe)
    for name, src in sources.items():  # scales after their weights: packed and placed like them
        if src.scale_of is not None:
            specs[name] = scale_spec(specs[src.scale_of])
    return specs


def check_heads_fit(heads: dict[str, tuple[int, int]], resolved: ResolvedPlan) -> None:
    """Every phase's attention kind can split every attention module's heads per TP rank."""
    for name, layout in resolved.phases.items():
        for q_heads, kv_heads in sorted(set(heads.values())):
            try:
                check_heads(layout.attention, layout, q_heads // layout.tp_size, kv_heads // layout.tp_size)
            except ValueError as e:
                raise PlanError(f"plan '{resolved.plan.name}', phase '{name}' (TP{layout.tp_size} x "
                                f"SP{layout.sp_size}): {e}") from None


def check_partial_sum_biases(model: nn.Module, outputs: dict[str, Output]) -> None:
    """A module whose output is a partial sum under TP must not add its bias inside (each rank
    would add it, TP times in the sum): only a linear that leaves it to the controller's reduce
    hook (`defer_bias`, dtgen.layers.linear.Linear) may carry one."""
    modules = dict(model.named_modules())
    for name, layout in outputs.items():
        module = modules[name]
        if (layout == Output.PARTIAL_SUM and isinstance(getattr(module, "bias", None), torch.Tensor)
                and not hasattr(module, "defer_bias")):
            raise PlanError(f"plan output '{name}' is a partial sum under TP, but its {type(module).__name__} "
                            f"adds a bias inside: build it as dtgen.layers.linear.Linear (its bias is then added "
                            f"once, after the sum)")


def _apply_fp8_options(adapter: ModelAdapter, model: nn.Module, dense_dtype: str, attention_dtype: str) -> None:
    """The FP8 load options on the model built on meta (dtgen/fp8.py): the adapter names the
    linears and the attention modules; a model that names none refuses the option."""
    name = type(adapter).__name__
    if dense_dtype == "fp8":
        linears = adapter.fp8_linears(model)
        if not linears:
            raise ValueError(f"--dense-dtype fp8: {name} names no linears to store in FP8")
        swap_fp8_linears(model, linears)
    if attention_dtype == "fp8":
        attentions, head_dim = adapter.fp8_attentions(model)
        if not attentions:
            raise ValueError(f"--attention-dtype fp8: {name} names no attention to run in FP8")
        use_fp8_attention(attentions, head_dim)


def _checked(adapter: ModelAdapter, plan: Plan, world_size: int, dtype: torch.dtype, fp8: str | None,
             dense_dtype: str = "model", attention_dtype: str = "model"):
    """Steps 1-3 up to the fit: the plan resolved and checked against the model on meta."""
    resolved = resolve(plan, world_size)
    with torch.device("meta"):
        model = adapter.build_on_meta()
        _apply_fp8_options(adapter, model, dense_dtype, attention_dtype)
    sources = param_sources(adapter, model)
    rules = match_rules(plan, [n for n in sources if sources[n].scale_of is None], adapter.unbuilt_modules(model))
    rules.update({n: rules[src.scale_of] for n, src in sources.items() if src.scale_of is not None})
    outputs = match_outputs(plan, [n for n, _ in model.named_modules()])
    check_partial_sum_biases(model, outputs)
    heads = adapter.attention_heads(model)
    check_heads_fit(heads, resolved)
    specs = param_specs(adapter, model, rules, dtype, fp8)
    pieces = resolved.storage_tp * resolved.num_micros
    for name, spec in specs.items():  # before any byte is read
        check_divisible(name, spec, pieces)
        check_fp8_split(name, spec, pieces)
    return resolved, model, outputs, heads, specs


def plan_problem(adapter: ModelAdapter, plan: Plan, world_size: int, fp8: str | None = None) -> str | None:
    """Why `build` would refuse this plan for this model at this world size (the same checks:
    the world size, heads per rank, divisibility of every split, FP8 block splits), or None.
    Nothing is read or allocated; the device fit is not part of it."""
    try:
        _checked(adapter, plan, world_size, torch.float32, fp8)
    except PlanError as e:
        return str(e)
    return None


# Room kept free beside the weights for the first activations (checked with them before loading).
WORKING_RESERVE_BYTES = 1 << 30


def planned_storage(adapter: ModelAdapter, plan: Plan, world_size: int, dtype: torch.dtype, fp8: str | None = None):
    """(bytes of one rank's resident weights, what they would take with FP8 experts or None),
    from the plan and the model on meta: nothing read or allocated. PlanError as `build`."""
    resolved, _, _, _, specs = _checked(adapter, plan, world_size, dtype, fp8)
    shard = StorageShard(resolved.storage_tp, 0, resolved.num_micros)  # every shard has the same size
    return planned_nbytes(specs, shard, dtype), fp8_alternative(specs, shard, dtype)


def budget_problem(adapter: ModelAdapter, plan: Plan, world_size: int, dtype: torch.dtype, fp8: str | None,
                   budget_bytes: int) -> str | None:
    """The one-line refusal of a memory budget that cannot hold a rank's weights (plus the
    working reserve), or None; for a launcher, before any rank starts."""
    weights, alternative = planned_storage(adapter, plan, world_size, dtype, fp8)
    return fit_problem(weights, "", plan.name, WORKING_RESERVE_BYTES, budget_bytes, alternative=alternative,
                       dtype=dtype)


def _all_ranks_max(timeout_s: float):
    """Elementwise max over every rank, on a gloo group of its own with the start-up
    timeout: ranks reach each weight as fast as they read, so the control group's short
    timeout would not do."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        host = t.float().cpu()
        dist.all_reduce(host, op=dist.ReduceOp.MAX, group=group)
        return host.to(t.device)
    return reduce_max


@dataclass
class Built:
    model: nn.Module
    controller: PhaseController
    storage: ResidentStorage
    plan: Plan
    specs: dict[str, ParamSpec]
    tokenizer: object = None   # a model's `load` puts its tokenizer here
    lora_prefixes: dict[str, str] = field(default_factory=dict)   # ModelAdapter.lora_prefixes


def build(adapter: ModelAdapter, plan: Plan, reader: CheckpointReader | None, rank: int = 0,
          world_size: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
          fp8: str | None = None, startup_timeout_s: float = 600.0, control_timeout_s: float = 60.0,
          memory_budget_bytes: int | None = None, dense_dtype: str = "model", attention_dtype: str = "model") -> Built:
    """Build on meta, read this rank's storage shard, and bind the first phase's views.

    reader: the checkpoint, or None for random weights (each rank makes its shard directly
    in its packed layout). fp8: the recipe of FP8 stacked weights (`dtgen.storage.FP8_RECIPES`).
    `startup_timeout_s` bounds how long ranks wait for each other to finish loading;
    `control_timeout_s` bounds every later phase agreement (see `Topology`).
    `memory_budget_bytes`: the weights (plus a working reserve) must fit this too, on any device.
    `dense_dtype`, `attention_dtype` "fp8": the adapter's `fp8_linears` in e4m3 (per-channel
    scales, quantized as read), its `fp8_attentions` on FP8 attention (dtgen/fp8.py); refused
    in one line, before any weight is read, on a device without FP8 or an SP kind that would not run it.
    """
    device = torch.device(device)
    check_dense_dtype(dense_dtype, device)
    check_attention_dtype(attention_dtype, device, tuple(ph.attention for ph in plan.phases.values()))
    resolved, model, outputs, heads, specs = _checked(adapter, plan, world_size, dtype, fp8, dense_dtype,
                                                      attention_dtype)
    # Every storage shard has the same size: check the fit before any group or byte exists.
    shard_shape = StorageShard(resolved.storage_tp, 0, resolved.num_micros)
    check_fits(planned_nbytes(specs, shard_shape, dtype), device, plan.name, reserve_bytes=WORKING_RESERVE_BYTES,
               budget_bytes=memory_budget_bytes, alternative=fp8_alternative(specs, shard_shape, dtype), dtype=dtype)
    topology = Topology(resolved, rank, device.type, control_timeout_s)
    any_fp8 = any(spec.fp8 for spec in specs.values())
    reduce_max = _all_ranks_max(startup_timeout_s) if any_fp8 and world_size > 1 else None
    shard = StorageShard(resolved.storage_tp, topology.storage_rank, resolved.num_micros)
    if reader is None:
        storage = ResidentStorage.random(specs, shard, dtype, device, reduce_max=reduce_max)
    else:
        validate_checkpoint(reader, specs, adapter.ignored_prefixes)
        storage = ResidentStorage.load(reader, specs, shard, dtype, device, reduce_max=reduce_max)
    # Ranks finish reading at different times; wait for all of them with a start-up timeout
    # before the first phase agreement (whose control timeout is short).
    topology.barrier("start-up (every rank loaded its shard)", startup_timeout_s)
    controller = PhaseController(model, storage, topology, outputs, list(heads))
    controller.activate(next(iter(plan.phases)))
    return Built(model, controller, storage, plan, specs, lora_prefixes=adapter.lora_prefixes(model))

"""Build HunyuanImage-3 on the meta device and describe how the checkpoint fills it.

`param_specs` turns the model's parameters plus a plan's rules into the storage's
`ParamSpec`s (official keys, official shapes, split units, dtypes). The storage then reads
each rank's shard; nothing here touches process groups.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dtgen.attention import ulysses_kv_heads
from dtgen.checkpoint import CheckpointReader
from dtgen.controller import PhaseController
from dtgen.plan import Plan, PlanError, ResolvedPlan, Rule, match_outputs, match_rules, resolve
from dtgen.storage import (FP8_RECIPES, ParamSpec, ResidentStorage, StorageShard, check_divisible, check_fits,
                           check_fp8_split, planned_nbytes, scale_spec, validate_checkpoint)
from kernels.fp8_quant import FP8_DTYPE, fp8_support_problem
from dtgen.topology import Topology

from .config import HunyuanImage3Config
from .model import HunyuanImage3ForCausalMM, set_moe_impl, unused_checkpoint_prefixes, use_fp8_experts
from .tokenizer import ByteTokenizer, load_tokenizer
from .transformer import Attention

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The routed experts' storage: the model dtype, or e4m3 quantized at load in one of
# kernels/fp8_quant.py's recipes.
MOE_DTYPES = ("model", "fp8")


def build_on_meta(cfg: HunyuanImage3Config, image_editing: bool = False) -> HunyuanImage3ForCausalMM:
    with torch.device("meta"):
        return HunyuanImage3ForCausalMM(cfg, image_editing)


def official_shape(meta_shape: torch.Size, stacked: bool, micro_packed: bool) -> tuple[int, ...]:
    shape = list(meta_shape)
    if micro_packed:
        shape = shape[1:]   # the micro dim (1 in the unsharded layout)
    if stacked:
        shape = shape[1:]   # the expert dim
    return tuple(shape)


def param_dtype(name: str, cfg: HunyuanImage3Config, dtype: torch.dtype) -> torch.dtype:
    if name.endswith("mlp.gate.wg.weight"):
        return torch.float32  # the router runs in fp32 (bf16 routing flips expert choices)
    if name.startswith("vae."):
        return _DTYPES.get(str(cfg.raw.get("vae_dtype", "float32")), torch.float32)
    return dtype


def param_specs(model: HunyuanImage3ForCausalMM, rules: dict[str, Rule], dtype: torch.dtype,
                fp8: str | None = None) -> dict[str, ParamSpec]:
    """fp8: the recipe of FP8 routed experts (their weights in e4m3, plus scale specs), or None."""
    cfg = model.cfg
    group_rows = cfg.qkv_rows // cfg.num_key_value_heads
    specs = {}
    sources = model.param_sources()
    for name, p in model.named_parameters():
        src = sources[name]
        if src.scale_of is not None:
            continue
        rule = rules[name]
        kv = rule == Rule.COLUMN_KV_GROUPS
        expert_weight = fp8 is not None and src.stacked
        specs[name] = ParamSpec(
            keys=src.keys, rule=rule, official_shape=official_shape(p.shape, src.stacked, src.micro_packed),
            stacked=src.stacked, micro_packed=src.micro_packed,
            unit=group_rows if kv else 1, unit_name="KV-head groups" if kv else
            ("columns" if rule == Rule.ROW else "rows"),
            dtype=FP8_DTYPE if expert_weight else param_dtype(name, cfg, dtype), fp8=fp8 if expert_weight else None)
    for name, src in sources.items():  # scales after their weights: packed and placed like them
        if src.scale_of is not None:
            specs[name] = scale_spec(specs[src.scale_of])
    return specs


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
class LoadedModel:
    model: HunyuanImage3ForCausalMM
    controller: PhaseController
    storage: ResidentStorage
    tokenizer: object
    plan: Plan
    reader: CheckpointReader | None


def check_plan_fits(cfg: HunyuanImage3Config, resolved: ResolvedPlan) -> None:
    """Model facts the generic divisibility checks cannot see: heads per rank for SP attention."""
    for name, layout in resolved.phases.items():
        if layout.attention in ("ulysses", "ulysses-pipelined", "ulysses-ring"):
            span = layout.sp_size
            if layout.attention == "ulysses-ring":  # Ulysses spans the inner sp axis only
                span = len(layout.sp_axis_groups[1][1][0])
            try:
                ulysses_kv_heads(cfg.num_attention_heads // layout.tp_size,
                                 cfg.num_key_value_heads // layout.tp_size, span)
            except ValueError as e:
                raise PlanError(f"plan '{resolved.plan.name}', phase '{name}' (TP{layout.tp_size} x "
                                f"SP{layout.sp_size}): {e}") from None


def load(checkpoint: str | Path | None, plan: Plan, rank: int = 0, world_size: int = 1,
         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
         moe_impl: str = "auto", random_config: dict | None = None, startup_timeout_s: float = 600.0,
         control_timeout_s: float = 60.0, moe_dtype: str = "model", fp8_scales: str = "channels",
         image_editing: bool = False) -> LoadedModel:
    """Build on meta, read this rank's storage shard, and bind the first phase's views.

    `image_editing`: also load the VAE encoder, the vision tower and its aligner (placed by
    the plan's rules like every other weight: replicated in the shipped plans).

    `moe_dtype` "fp8": the routed experts are quantized to e4m3 as they are read, with
    `fp8_scales` "channels" (one scale per weight row) or "blocks" (128 x 128 blocks).

    `startup_timeout_s` bounds how long ranks wait for each other to finish loading;
    `control_timeout_s` bounds every later phase agreement (see `Topology`).

    With `random_config` (a config.json dict) no checkpoint is read: each rank creates its
    shard with random values, directly in its packed layout.
    """
    device = torch.device(device)
    if moe_dtype not in MOE_DTYPES:
        raise ValueError(f"moe_dtype must be one of {MOE_DTYPES}, got {moe_dtype!r}")
    if moe_dtype == "fp8":
        if fp8_scales not in FP8_RECIPES:
            raise ValueError(f"fp8_scales must be one of {FP8_RECIPES}, got {fp8_scales!r}")
        problem = fp8_support_problem(device)
        if problem:
            raise RuntimeError(f"--moe-dtype fp8: {problem}")
    if random_config is not None:
        cfg = HunyuanImage3Config.from_dict(random_config)
    else:
        cfg = HunyuanImage3Config.from_json(Path(checkpoint) / "config.json")
    resolved = resolve(plan, world_size)
    model = build_on_meta(cfg, image_editing)
    if moe_dtype == "fp8":
        with torch.device("meta"):
            use_fp8_experts(model)
    set_moe_impl(model, moe_impl)
    sources = model.param_sources()
    rules = match_rules(plan, [n for n in sources if sources[n].scale_of is None], model.unbuilt_modules())
    rules.update({n: rules[src.scale_of] for n, src in sources.items() if src.scale_of is not None})
    outputs = match_outputs(plan, [n for n, _ in model.named_modules()])
    check_plan_fits(cfg, resolved)
    specs = param_specs(model, rules, dtype, fp8_scales if moe_dtype == "fp8" else None)
    for name, spec in specs.items():  # before any byte is read
        check_divisible(name, spec, resolved.storage_tp * resolved.num_micros)
        check_fp8_split(name, spec, resolved.storage_tp * resolved.num_micros)
    # Every storage shard has the same size: check the fit before any group or byte exists.
    check_fits(planned_nbytes(specs, StorageShard(resolved.storage_tp, 0, resolved.num_micros), dtype), device,
               plan.name, reserve_bytes=1 << 30)
    topology = Topology(resolved, rank, device.type, control_timeout_s)
    reduce_max = _all_ranks_max(startup_timeout_s) if moe_dtype == "fp8" and world_size > 1 else None
    shard = StorageShard(resolved.storage_tp, topology.storage_rank, resolved.num_micros)
    if random_config is not None:
        reader = None
        storage = ResidentStorage.random(specs, shard, dtype, device, reduce_max=reduce_max)
        tokenizer = ByteTokenizer(cfg)
    else:
        reader = CheckpointReader(checkpoint)
        validate_checkpoint(reader, specs, unused_checkpoint_prefixes(image_editing))
        storage = ResidentStorage.load(reader, specs, shard, dtype, device, reduce_max=reduce_max)
        reader.close()
        tokenizer = load_tokenizer(checkpoint, cfg)
    attention = [n for n, m in model.named_modules() if isinstance(m, Attention)]
    # Ranks finish reading at different times; wait for all of them with a start-up timeout
    # before the first phase agreement (whose control timeout is short).
    topology.barrier("start-up (every rank loaded its shard)", startup_timeout_s)
    controller = PhaseController(model, storage, topology, outputs, attention)
    controller.activate(next(iter(plan.phases)))
    return LoadedModel(model, controller, storage, tokenizer, plan, reader)

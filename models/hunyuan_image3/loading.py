"""Build HunyuanImage-3 on the meta device and describe how the checkpoint fills it.

`param_specs` turns the model's parameters plus a plan's rules into the storage's
`ParamSpec`s (official keys, official shapes, split units, dtypes). The storage then reads
each rank's shard; nothing here touches process groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dtgen.attention import ulysses_kv_heads
from dtgen.checkpoint import CheckpointReader
from dtgen.controller import PhaseController
from dtgen.plan import Plan, PlanError, ResolvedPlan, Rule, match_outputs, match_rules, resolve
from dtgen.storage import (ParamSpec, ResidentStorage, StorageShard, check_divisible, check_fits, planned_nbytes,
                           validate_checkpoint)
from dtgen.topology import Topology

from .config import HunyuanImage3Config
from .model import UNUSED_CHECKPOINT_PREFIXES, HunyuanImage3ForCausalMM, set_moe_impl
from .tokenizer import ByteTokenizer, load_tokenizer
from .transformer import Attention

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_on_meta(cfg: HunyuanImage3Config) -> HunyuanImage3ForCausalMM:
    with torch.device("meta"):
        return HunyuanImage3ForCausalMM(cfg)


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


def param_specs(model: HunyuanImage3ForCausalMM, rules: dict[str, Rule], dtype: torch.dtype) -> dict[str, ParamSpec]:
    cfg = model.cfg
    group_rows = cfg.qkv_rows // cfg.num_key_value_heads
    specs = {}
    sources = model.param_sources()
    for name, p in model.named_parameters():
        src = sources[name]
        rule = rules[name]
        kv = rule == Rule.COLUMN_KV_GROUPS
        specs[name] = ParamSpec(
            keys=src.keys, rule=rule, official_shape=official_shape(p.shape, src.stacked, src.micro_packed),
            stacked=src.stacked, micro_packed=src.micro_packed,
            unit=group_rows if kv else 1, unit_name="KV-head groups" if kv else
            ("columns" if rule == Rule.ROW else "rows"),
            dtype=param_dtype(name, cfg, dtype))
    return specs


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
         control_timeout_s: float = 60.0) -> LoadedModel:
    """Build on meta, read this rank's storage shard, and bind the first phase's views.

    `startup_timeout_s` bounds how long ranks wait for each other to finish loading;
    `control_timeout_s` bounds every later phase agreement (see `Topology`).

    With `random_config` (a config.json dict) no checkpoint is read: each rank creates its
    shard with random values, directly in its packed layout.
    """
    device = torch.device(device)
    if random_config is not None:
        cfg = HunyuanImage3Config.from_dict(random_config)
    else:
        cfg = HunyuanImage3Config.from_json(Path(checkpoint) / "config.json")
    resolved = resolve(plan, world_size)
    model = build_on_meta(cfg)
    set_moe_impl(model, moe_impl)
    rules = match_rules(plan, [n for n, _ in model.named_parameters()])
    outputs = match_outputs(plan, [n for n, _ in model.named_modules()])
    check_plan_fits(cfg, resolved)
    specs = param_specs(model, rules, dtype)
    for name, spec in specs.items():  # before any byte is read
        check_divisible(name, spec, resolved.storage_tp * resolved.num_micros)
    # Every storage shard has the same size: check the fit before any group or byte exists.
    check_fits(planned_nbytes(specs, StorageShard(resolved.storage_tp, 0, resolved.num_micros), dtype), device,
               plan.name, reserve_bytes=1 << 30)
    topology = Topology(resolved, rank, device.type, control_timeout_s)
    shard = StorageShard(resolved.storage_tp, topology.storage_rank, resolved.num_micros)
    if random_config is not None:
        reader = None
        storage = ResidentStorage.random(specs, shard, dtype, device)
        tokenizer = ByteTokenizer(cfg)
    else:
        reader = CheckpointReader(checkpoint)
        validate_checkpoint(reader, specs, UNUSED_CHECKPOINT_PREFIXES)
        storage = ResidentStorage.load(reader, specs, shard, dtype, device)
        reader.close()
        tokenizer = load_tokenizer(checkpoint, cfg)
    attention = [n for n, m in model.named_modules() if isinstance(m, Attention)]
    # Ranks finish reading at different times; wait for all of them with a start-up timeout
    # before the first phase agreement (whose control timeout is short).
    topology.barrier("start-up (every rank loaded its shard)", startup_timeout_s)
    controller = PhaseController(model, storage, topology, outputs, attention)
    controller.activate(next(iter(plan.phases)))
    return LoadedModel(model, controller, storage, tokenizer, plan, reader)

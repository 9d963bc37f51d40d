"""HunyuanImage-3 for the framework's build: its adapter, and `load` (adapter + build + tokenizer).

`HunyuanAdapter` says what `dtgen.build` cannot know: the module tree, where each parameter
lives in the official checkpoint (experts stacked, gate/up micro-packed), the router's fp32,
the VAE's dtype, the fused QKV's KV-head groups, and the checkpoint sections text-to-image
never reads. Everything else (plan checks, storage, groups, controller) is the framework's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from pathlib import Path

import torch
from torch import nn

from dtgen.build import (ModelAdapter, ParamSource, budget_problem, build, check_heads_fit,
                         param_specs as framework_param_specs)
from dtgen.checkpoint import CheckpointError, CheckpointReader
from dtgen.controller import PhaseController
from dtgen.fp8 import check_dense_dtype
from dtgen.lora import ResidentLoras
from dtgen.refusal import DeviceRefusal
from dtgen.plan import Plan, ResolvedPlan, Rule
from dtgen.storage import FP8_RECIPES, ParamSpec, ResidentStorage
from kernels.fp8_quant import fp8_support_problem
from kernels.moe_dispatch import moe_impl_device_problem, moe_impl_problem

from .config import HunyuanImage3Config
from .model import HunyuanImage3ForCausalMM, set_moe_impl, unused_checkpoint_prefixes, use_fp8_dense, use_fp8_experts
from .tokenizer import ByteTokenizer, load_tokenizer
from .transformer import Attention

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# LoRA name map (dtgen/lora): the checkpoint keys are the official module names, which a PEFT
# adapter folder made on the official model names as they are ("" : its unprefixed paths), and a
# diffusers-style file prefixes with its component, `transformer.`. Routed experts are refused.
LORA_PREFIXES = {"": "", "transformer.": ""}
# The routed experts' storage: the model dtype, or e4m3 quantized at load in one of
# kernels/fp8_quant.py's recipes.
MOE_DTYPES = ("model", "fp8")


@dataclass
class HunyuanAdapter(ModelAdapter):
    """HunyuanImage-3 for `dtgen.build`."""

    cfg: HunyuanImage3Config
    image_editing: bool = False
    fp8_experts: bool = False
    moe_impl: str = "auto"
    vae_dtype: str | None = None    # None: the config's vae_dtype (float32 by default)
    fp8_dense: bool = False   # QKV, O, the shared MLP and the lm_head in e4m3 (model.use_fp8_dense)

    @property
    def ignored_prefixes(self) -> tuple[str, ...]:
        return unused_checkpoint_prefixes(self.image_editing)

    def build_on_meta(self) -> HunyuanImage3ForCausalMM:
        model = HunyuanImage3ForCausalMM(self.cfg, self.image_editing)
        if self.fp8_experts:
            use_fp8_experts(model)
        if self.fp8_dense:
            use_fp8_dense(model)
        set_moe_impl(model, self.moe_impl)
        return model

    def fp8_attentions(self, model: HunyuanImage3ForCausalMM) -> tuple[list[nn.Module], int]:
        """Every decoder layer's attention (`build(attention_dtype="fp8")`): its dense pieces, the
        denoise image rows and an edit's condition-image rows at prefill, run on FP8 attention;
        text rows and the AR decode step stay on the model dtype's kernels."""
        return [layer.self_attn for layer in model.model.layers], self.cfg.head_dim

    def attention_heads(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        heads = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads)
        return {n: heads for n, m in model.named_modules() if isinstance(m, Attention)}

    def param_sources(self, model: HunyuanImage3ForCausalMM) -> dict[str, ParamSource]:
        return model.param_sources()

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        if name.endswith("mlp.gate.wg.weight"):
            return torch.float32  # the router runs in fp32 (bf16 routing flips expert choices)
        if name.startswith("vae."):
            return _DTYPES.get(self.vae_dtype or str(self.cfg.raw.get("vae_dtype", "float32")), torch.float32)
        return dtype

    def split_unit(self, name: str, rule: Rule) -> tuple[int, str] | None:
        if rule == Rule.COLUMN_KV_GROUPS:
            return self.cfg.qkv_rows // self.cfg.num_key_value_heads, "KV-head groups"
        return None

    def unbuilt_modules(self, model: HunyuanImage3ForCausalMM) -> tuple[str, ...]:
        return model.unbuilt_modules()

    def lora_prefixes(self, model: HunyuanImage3ForCausalMM) -> dict[str, str]:
        return dict(LORA_PREFIXES)


def memory_budget_problem(cfg: HunyuanImage3Config, plan: Plan, world_size: int, dtype: torch.dtype,
                          moe_dtype: str, fp8_scales: str, image_editing: bool, budget_bytes: int,
                          vae_dtype: str | None = None, dense_dtype: str = "model") -> str | None:
    """The one-line refusal of a memory budget that cannot hold a rank's weights, saying what
    FP8 experts would take; nothing read (the model on meta)."""
    fp8 = moe_dtype == "fp8"
    adapter = HunyuanAdapter(cfg, image_editing, fp8_experts=fp8, vae_dtype=vae_dtype,
                             fp8_dense=dense_dtype == "fp8")
    return budget_problem(adapter, plan, world_size, dtype, fp8_scales if fp8 else None, budget_bytes)


def lora_targets(cfg: HunyuanImage3Config, image_editing: bool = False) -> ResidentLoras:
    """What an adapter is matched against before any rank loads: the model on meta, its weights'
    specs and name map (`ResidentLoras.match`: names, shapes, routed experts refused); nothing
    read, nothing resident."""
    model = build_on_meta(cfg, image_editing)
    specs = param_specs(model, {n: Rule.REPLICATE for n, _ in model.named_parameters()}, torch.float32)
    meta = SimpleNamespace(model=model, storage=SimpleNamespace(specs=specs), lora_prefixes=dict(LORA_PREFIXES))
    return ResidentLoras(meta, torch.float32)


def build_on_meta(cfg: HunyuanImage3Config, image_editing: bool = False) -> HunyuanImage3ForCausalMM:
    with torch.device("meta"):
        return HunyuanAdapter(cfg, image_editing).build_on_meta()


def param_specs(model: HunyuanImage3ForCausalMM, rules: dict[str, Rule], dtype: torch.dtype,
                fp8: str | None = None) -> dict[str, ParamSpec]:
    """fp8: the recipe of FP8 routed experts (their weights in e4m3, plus scale specs), or None."""
    adapter = HunyuanAdapter(model.cfg, model.vision_model is not None, fp8 is not None)
    return framework_param_specs(adapter, model, rules, dtype, fp8)


def check_plan_fits(cfg: HunyuanImage3Config, resolved: ResolvedPlan) -> None:
    """Heads per rank for SP attention (the generic divisibility checks cannot see them)."""
    check_heads_fit({"attention": (cfg.num_attention_heads, cfg.num_key_value_heads)}, resolved)


# The Instruct-Distil sampler's embedders: the config flag that builds each, and its weights.
DISTILLED_EMBEDDERS = (("cfg_distilled", "guidance_emb."), ("use_meanflow", "timestep_r_emb."))


def _check_distilled_weights(cfg: HunyuanImage3Config, reader: CheckpointReader) -> None:
    """A config and a checkpoint that disagree about the distilled sampler, said in one line
    (rather than as a list of missing or unexpected keys)."""
    keys = reader.keys()
    for flag, prefix in DISTILLED_EMBEDDERS:
        has = any(k.startswith(prefix) for k in keys)
        if getattr(cfg, flag) and not has:
            raise CheckpointError(f"config.json says {flag}: true (the Instruct-Distil sampler), but the checkpoint "
                                  f"has no {prefix}* weights")
        if has and not getattr(cfg, flag):
            raise CheckpointError(f"the checkpoint has {prefix}* weights (the Instruct-Distil sampler), but config.json "
                                  f"does not say {flag}: true")


@dataclass
class LoadedModel:
    model: HunyuanImage3ForCausalMM
    controller: PhaseController
    storage: ResidentStorage
    tokenizer: object
    plan: Plan
    reader: CheckpointReader | None
    lora_prefixes: dict[str, str] = field(default_factory=dict)   # HunyuanAdapter.lora_prefixes


def load(checkpoint: str | Path | None, plan: Plan, rank: int = 0, world_size: int = 1,
         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
         moe_impl: str = "auto", random_config: dict | None = None, startup_timeout_s: float = 600.0,
         control_timeout_s: float = 60.0, moe_dtype: str = "model", fp8_scales: str = "channels",
         image_editing: bool = False, memory_budget_bytes: int | None = None,
         vae_dtype: str | None = None, dense_dtype: str = "model", attention_dtype: str = "model") -> LoadedModel:
    """Build on meta, read this rank's storage shard, and bind the first phase's views.

    `image_editing`: also load the VAE encoder, the vision tower and its aligner (placed by
    the plan's rules like every other weight: replicated in the shipped plans).

    `moe_dtype` "fp8": the routed experts are quantized to e4m3 as they are read, with
    `fp8_scales` "channels" (one scale per weight row), "blocks" (128 x 128 blocks) or
    "tensor" (one per expert matrix).

    `dense_dtype` "fp8": every layer's QKV, O and shared MLP, and the lm_head, stored in e4m3 with one scale per
    output channel (quantized as read; under TP the scales split with the weight's rows, or
    are replicated for a column-split weight), activations quantized per token
    (kernels/fp8_linear.py). Refused before any weight is read on a GPU without FP8.

    `attention_dtype` "fp8": every layer's attention runs its dense pieces (the denoise image
    rows over their key prefix, an edit's condition-image rows at prefill) on
    kernels/fp8_attention.py (INT8 QK, FP8 PV); text rows and the AR decode step stay in the
    model dtype (`HunyuanAdapter.fp8_attentions`). Refused in one line before any weight is
    read (dtgen.build): a bad value, a GPU without FP8, a plan whose SP attention kind would
    not run it, a head_dim over the kernel's 128.

    `startup_timeout_s` bounds how long ranks wait for each other to finish loading;
    `control_timeout_s` bounds every later phase agreement (see `Topology`).
    `memory_budget_bytes`: a rank's weights (plus a working reserve) must fit it, else
    MemoryError before any weight is read (as for the device's free memory).
    `vae_dtype` ("float32", "bfloat16", "float16"): the VAE's weights and compute, instead of
    the config's vae_dtype (float32 in the released checkpoints).

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
            raise DeviceRefusal(f"--moe-dtype fp8: {problem}")
    problem = moe_impl_problem(moe_impl, fp8_scales if moe_dtype == "fp8" else None)
    if problem:
        raise ValueError(problem)
    problem = moe_impl_device_problem(moe_impl, device)
    if problem:
        raise DeviceRefusal(f"--moe-impl {moe_impl}: {problem}")
    check_dense_dtype(dense_dtype, device)
    if random_config is not None:
        cfg = HunyuanImage3Config.from_dict(random_config)
    else:
        cfg = HunyuanImage3Config.from_json(Path(checkpoint) / "config.json")
    if vae_dtype is not None and vae_dtype not in _DTYPES:
        raise ValueError(f"vae_dtype must be one of {sorted(_DTYPES)}, got {vae_dtype!r}")
    adapter = HunyuanAdapter(cfg, image_editing, fp8_experts=moe_dtype == "fp8", moe_impl=moe_impl,
                             vae_dtype=vae_dtype, fp8_dense=dense_dtype == "fp8")
    reader = None if random_config is not None else CheckpointReader(checkpoint)
    if reader is not None:
        _check_distilled_weights(cfg, reader)
    try:
        built = build(adapter, plan, reader, rank, world_size, dtype, device,
                      fp8_scales if moe_dtype == "fp8" else None, startup_timeout_s, control_timeout_s,
                      memory_budget_bytes, attention_dtype=attention_dtype)
    finally:
        if reader is not None:
            reader.close()
    tokenizer = ByteTokenizer(cfg) if reader is None else load_tokenizer(checkpoint, cfg)
    return LoadedModel(built.model, built.controller, built.storage, tokenizer, plan, reader, built.lora_prefixes)

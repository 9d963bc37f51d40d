"""Qwen-Image text-to-image as one module tree, its adapter for `dtgen.build`, and `load`.

The tree mirrors the diffusers folder (`text_encoder/`, `transformer/`, `vae/`, `tokenizer/`,
`scheduler/`): parameter names are the folder's name plus the component's own key, so
`ComponentsReader` serves them with no mapping. Everything stays resident; the phases
(encode, denoise, decode) only change which modules run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dtgen.build import ModelAdapter, build
from dtgen.checkpoint import CheckpointError, ComponentsReader
from dtgen.fp8 import check_attention_dtype, check_dense_dtype, swap_fp8_linears, use_fp8_attention
from dtgen.layers.config import read_json
from dtgen.plan import Plan, Rule

from . import text_encoder as te
from .transformer import Attention, QwenImageTransformer, QwenImageTransformerConfig
from .vae import IGNORED_CHECKPOINT_PREFIXES, QwenImageVAE, vae_config

COMPONENTS = ("text_encoder", "transformer", "vae")
# `--dense-dtype fp8`: every linear of the MMDiT's blocks (both streams' projections, MLPs and
# modulations); the text encoder, the embedders and the output projection keep the model dtype.
FP8_LINEARS = ("transformer.transformer_blocks.*.attn.*", "transformer.transformer_blocks.*_mlp.net.*",
               "transformer.transformer_blocks.*_mod.1")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class QwenImageConfigs:
    text_encoder: te.QwenTextConfig
    transformer: QwenImageTransformerConfig
    vae: object        # the WanVAEConfig of its decoder
    scheduler: dict

    @classmethod
    def from_folder(cls, folder: str | Path) -> "QwenImageConfigs":
        folder = Path(folder)
        missing = [c for c in (*COMPONENTS, "tokenizer", "scheduler") if not (folder / c).is_dir()]
        if missing:
            raise CheckpointError(f"{folder} is missing the component folder(s) {missing} (a diffusers-format "
                                  f"Qwen-Image checkpoint has {[*COMPONENTS, 'tokenizer', 'scheduler']})")
        return cls(te.QwenTextConfig.from_json(folder / "text_encoder" / "config.json"),
                   QwenImageTransformerConfig.from_json(folder / "transformer" / "config.json"),
                   vae_config(read_json(folder / "vae" / "config.json")),
                   read_json(folder / "scheduler" / "scheduler_config.json"))


class QwenImageT2I(nn.Module):
    def __init__(self, cfgs: QwenImageConfigs):
        super().__init__()
        self.cfgs = cfgs
        self.text_encoder = te.QwenTextEncoder(cfgs.text_encoder)
        self.transformer = QwenImageTransformer(cfgs.transformer)
        self.vae = QwenImageVAE(cfgs.vae)


@dataclass
class QwenImageAdapter(ModelAdapter):
    """Qwen-Image for `dtgen.build`: its attention modules, whole heads per TP split, the VAE's dtype."""

    cfgs: QwenImageConfigs
    vae_dtype: torch.dtype = torch.float32
    ignored_prefixes: tuple[str, ...] = (*(f"text_encoder.{p}" for p in te.IGNORED_CHECKPOINT_PREFIXES),
                                         *(f"vae.{p}" for p in IGNORED_CHECKPOINT_PREFIXES))
    dense_fp8: bool = False         # the MMDiT blocks' linears in e4m3 (FP8_LINEARS)
    attention_fp8: bool = False     # the joint attention in FP8 (kernels/fp8_attention.py)

    def build_on_meta(self) -> QwenImageT2I:
        model = QwenImageT2I(self.cfgs)
        if self.dense_fp8:
            swap_fp8_linears(model, FP8_LINEARS)
        if self.attention_fp8:
            use_fp8_attention(model.transformer.joint_attentions(), self.cfgs.transformer.attention_head_dim)
        return model

    def attention_heads(self, model: QwenImageT2I) -> dict[str, tuple[int, int]]:
        n = self.cfgs.transformer.num_attention_heads
        return {f"transformer.{name}": (n, n) for name, m in model.transformer.named_modules()
                if isinstance(m, Attention)}

    def split_unit(self, name: str, rule: Rule) -> tuple[int, str] | None:
        # A TP shard of a projection holds whole heads (the attention reads heads off its rows).
        if ".attn." in name and rule != Rule.REPLICATE:
            return self.cfgs.transformer.attention_head_dim, "heads"
        if ".self_attn." in name and rule != Rule.REPLICATE:
            return self.cfgs.text_encoder.head_dim, "heads"
        return None

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        return self.vae_dtype if name.startswith("vae.") else dtype


@dataclass
class LoadedQwenImage:
    model: QwenImageT2I
    controller: object
    storage: object
    tokenizer: object
    plan: object


def load(checkpoint: str | Path, plan: Plan, rank: int = 0, world_size: int = 1,
         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
         vae_dtype: str = "float32", dense_dtype: str = "model", attention_dtype: str = "model") -> LoadedQwenImage:
    """A diffusers-format Qwen-Image folder -> this rank's resident weights + controller.

    `dense_dtype` "fp8": the MMDiT blocks' linears (FP8_LINEARS) in e4m3, one scale per output
    channel, quantized as they are read; `attention_dtype` "fp8": the joint attention in FP8
    (dtgen/fp8.py, as Wan's). Either one on a GPU without FP8 is refused before any weight is read."""
    if vae_dtype not in _DTYPES:
        raise ValueError(f"vae_dtype must be one of {sorted(_DTYPES)}, got {vae_dtype!r}")
    check_dense_dtype(dense_dtype, torch.device(device))
    check_attention_dtype(attention_dtype, torch.device(device), tuple(ph.attention for ph in plan.phases.values()))
    cfgs = QwenImageConfigs.from_folder(checkpoint)
    tokenizer = te.load_tokenizer(Path(checkpoint) / "tokenizer")   # before any weight: a bad folder fails fast
    reader = ComponentsReader(checkpoint, COMPONENTS)
    adapter = QwenImageAdapter(cfgs, _DTYPES[vae_dtype], dense_fp8=dense_dtype == "fp8",
                               attention_fp8=attention_dtype == "fp8")
    try:
        built = build(adapter, plan, reader, rank, world_size, dtype, device)
    finally:
        reader.close()
    return LoadedQwenImage(built.model, built.controller, built.storage, tokenizer, plan)

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

from dtgen.build import Built, ModelAdapter, build
from dtgen.checkpoint import CheckpointError, ComponentsReader
from dtgen.devices import named_dtype
from dtgen.layers.config import read_json
from dtgen.layers.wan_vae import IGNORED_CHECKPOINT_PREFIXES, WanVAE, WanVAEConfig
from dtgen.plan import Plan, Rule

from . import text_encoder as te
from .transformer import Attention, QwenImageTransformer, QwenImageTransformerConfig

COMPONENTS = ("text_encoder", "transformer", "vae")
# `--dense-dtype fp8`: every linear of the MMDiT's blocks (both streams' projections, MLPs and
# modulations); the text encoder, the embedders and the output projection keep the model dtype.
FP8_LINEARS = ("transformer.transformer_blocks.*.attn.*", "transformer.transformer_blocks.*_mlp.net.*",
               "transformer.transformer_blocks.*_mod.1")

# LoRA name map (dtgen/lora): diffusers' files name the MMDiT's modules `transformer.<path>`, as
# its checkpoint keys do; a PEFT folder made on the transformer names them `<path>`.
LORA_PREFIXES = {"transformer.": "transformer.", "": "transformer."}


@dataclass(frozen=True)
class QwenImageConfigs:
    text_encoder: te.QwenTextConfig
    transformer: QwenImageTransformerConfig
    # diffusers' AutoencoderKLQwenImage is the Wan 2.1 VAE; an image decodes as one latent frame
    vae: WanVAEConfig
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
                   WanVAEConfig.from_qwen_image(read_json(folder / "vae" / "config.json")),
                   read_json(folder / "scheduler" / "scheduler_config.json"))


class QwenImageT2I(nn.Module):
    def __init__(self, cfgs: QwenImageConfigs):
        super().__init__()
        self.cfgs = cfgs
        self.text_encoder = te.QwenTextEncoder(cfgs.text_encoder)
        self.transformer = QwenImageTransformer(cfgs.transformer)
        self.vae = WanVAE(cfgs.vae)


@dataclass
class QwenImageAdapter(ModelAdapter):
    """Qwen-Image for `dtgen.build`: its attention modules, whole heads per TP split, the VAE's dtype."""

    cfgs: QwenImageConfigs
    vae_dtype: torch.dtype = torch.float32
    ignored_prefixes: tuple[str, ...] = (*(f"text_encoder.{p}" for p in te.IGNORED_CHECKPOINT_PREFIXES),
                                         *(f"vae.{p}" for p in IGNORED_CHECKPOINT_PREFIXES))
    def build_on_meta(self) -> QwenImageT2I:
        return QwenImageT2I(self.cfgs)

    def fp8_linears(self, model: QwenImageT2I) -> list[str]:
        return list(FP8_LINEARS)

    def fp8_attentions(self, model: QwenImageT2I) -> tuple[list[nn.Module], int]:
        return model.transformer.joint_attentions(), self.cfgs.transformer.attention_head_dim

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

    def lora_prefixes(self, model: QwenImageT2I) -> dict[str, str]:
        return dict(LORA_PREFIXES)


def load(checkpoint: str | Path, plan: Plan, rank: int = 0, world_size: int = 1,
         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
         vae_dtype: str = "float32", dense_dtype: str = "model", attention_dtype: str = "model") -> Built:
    """A diffusers-format Qwen-Image folder -> this rank's resident weights + controller.

    `dense_dtype` "fp8": the MMDiT blocks' linears (FP8_LINEARS) in e4m3, one scale per output
    channel, quantized as they are read; `attention_dtype` "fp8": the joint attention in FP8
    (dtgen/fp8.py, as Wan's). Either one on a GPU without FP8 is refused before any weight is read."""
    vae = named_dtype(vae_dtype, "vae_dtype")
    cfgs = QwenImageConfigs.from_folder(checkpoint)
    tokenizer = te.load_tokenizer(Path(checkpoint) / "tokenizer")   # before any weight: a bad folder fails fast
    reader = ComponentsReader(checkpoint, COMPONENTS)
    try:
        built = build(QwenImageAdapter(cfgs, vae), plan, reader, rank, world_size, dtype, device,
                      dense_dtype=dense_dtype, attention_dtype=attention_dtype)
    finally:
        reader.close()
    built.tokenizer = tokenizer
    return built

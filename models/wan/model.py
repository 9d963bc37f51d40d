"""Wan text-to-video and image-to-video as one module tree, its adapter for `dtgen.build`, and `load`.

The tree mirrors a diffusers-format checkpoint folder: `text_encoder` (UMT5), `transformer`
(the DiT), `transformer_2` (Wan2.2-A14B's low-noise DiT, when the checkpoint has one), `vae`
(the decoder; on an image-to-video checkpoint, `WanImageToVideoPipeline`'s, also the encoder of
the reference frame) and `image_encoder` (Wan2.1-I2V's CLIP vision tower, with the folder's
`image_processor` config; Wan2.2-I2V-A14B has none). Parameter names are the folder's name plus
the component's own state-dict key, so `dtgen.checkpoint.ComponentsReader` serves them with no
mapping (the CLIP tower's keys with or without their older `vision_model.` prefix). All of them
stay resident: the phases (encode, denoise, decode) and the A14B expert switch only change which
modules run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dtgen.build import Built, ModelAdapter, ParamSource, build
from dtgen.checkpoint import CheckpointError, ComponentsReader
from dtgen.devices import named_dtype
from dtgen.layers.clip_vision import CHECKPOINT_PREFIX, CLIPImagePreprocessor, CLIPVisionConfig, CLIPVisionTower
from dtgen.layers.config import read_json
from dtgen.layers.t5 import EMBEDDING_KEYS, UMT5Config, UMT5Encoder, load_tokenizer
from dtgen.layers.wan_vae import IGNORED_CHECKPOINT_PREFIXES, WanVAE, WanVAEConfig
from dtgen.plan import Plan

from .transformer import Attention, WanTransformer, WanTransformerConfig, keeps_fp32

TEXT_TO_VIDEO = ("text_encoder", "tokenizer", "transformer", "vae")
# model_index.json's pipeline classes: text to video, and image to video (a reference first frame).
T2V_PIPELINE, I2V_PIPELINE = "WanPipeline", "WanImageToVideoPipeline"
# The DiT linears `dense_dtype="fp8"` stores in e4m3 (globs under a DiT): every block's
# attention projections and FFN, where nearly all of its GEMM FLOPs are. The embedders,
# the time projection and proj_out stay in the model dtype (small; the time path is float32).
FP8_LINEARS = ("blocks.*.attn?.to_?", "blocks.*.attn?.to_out.0", "blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2")

# LoRA name map (dtgen/lora): diffusers' files name the DiT's modules `transformer.<path>`, as its
# checkpoint keys do; a PEFT folder made on the DiT names them `<path>`. Wan2.2-A14B's low-noise
# expert takes the same file under `LORA_PREFIXES_EXPERT_2` (diffusers' `load_into_transformer_2`).
LORA_PREFIXES = {"transformer.": "transformer.", "": "transformer."}
LORA_PREFIXES_EXPERT_2 = {"transformer.": "transformer_2.", "": "transformer_2."}


@dataclass(frozen=True)
class WanConfigs:
    text_encoder: UMT5Config
    transformer: WanTransformerConfig
    vae: WanVAEConfig
    transformer_2: WanTransformerConfig | None = None
    # Wan2.2-A14B: the high-noise DiT runs while t >= boundary_ratio * 1000, the low-noise one after.
    boundary_ratio: float | None = None
    # Image to video (WanImageToVideoPipeline): the reference frame's VAE latents are the DiT's
    # condition channels; Wan2.1-I2V also attends to its CLIP features (image_encoder, image_processor).
    image_to_video: bool = False
    image_encoder: CLIPVisionConfig | None = None
    image_processor: CLIPImagePreprocessor | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "WanConfigs":
        folder = Path(folder)
        index = read_json(folder / "model_index.json") if (folder / "model_index.json").exists() else {}
        i2v = index.get("_class_name") == I2V_PIPELINE

        def present(name: str) -> bool:   # a component model_index.json lists (null: left out)
            return (folder / name).is_dir() and (index.get(name) or [None])[0] is not None

        clip = i2v and present("image_encoder")
        needed = TEXT_TO_VIDEO + (("image_encoder", "image_processor") if clip else ())
        missing = [c for c in needed if not (folder / c).is_dir()]
        if missing:
            raise CheckpointError(f"{folder} is missing the component folder(s) {missing} (a diffusers-format "
                                  f"Wan checkpoint has {list(needed)})")
        if index.get("expand_timesteps"):
            raise CheckpointError(f"{folder}: model_index.json's expand_timesteps (Wan2.2 TI2V-5B's per-token "
                                  "timesteps for image to video) is not supported")
        transformer = WanTransformerConfig.from_json(folder / "transformer" / "config.json")
        if transformer.image_tokens and not clip:
            raise CheckpointError(f"{folder}: the transformer attends to image tokens (image_dim) but the folder "
                                  "has no image_encoder listed in model_index.json")
        return cls(UMT5Config.from_json(folder / "text_encoder" / "config.json"), transformer,
                   WanVAEConfig.from_json(folder / "vae" / "config.json"),
                   WanTransformerConfig.from_json(folder / "transformer_2" / "config.json")
                   if present("transformer_2") else None,
                   index.get("boundary_ratio"), i2v,
                   CLIPVisionConfig.from_json(folder / "image_encoder" / "config.json") if clip else None,
                   CLIPImagePreprocessor.from_json(folder / "image_processor" / "preprocessor_config.json")
                   if clip else None)

    @property
    def components(self) -> tuple[str, ...]:
        return (("text_encoder", "transformer", "vae") + (("transformer_2",) if self.transformer_2 else ())
                + (("image_encoder",) if self.image_encoder else ()))


class WanT2V(nn.Module):
    def __init__(self, cfgs: WanConfigs):
        super().__init__()
        self.cfgs = cfgs
        self.text_encoder = UMT5Encoder(cfgs.text_encoder)
        self.transformer = WanTransformer(cfgs.transformer)
        self.transformer_2 = WanTransformer(cfgs.transformer_2) if cfgs.transformer_2 else None
        self.vae = WanVAE(cfgs.vae, encoder=cfgs.image_to_video)
        self.image_encoder = CLIPVisionTower(cfgs.image_encoder) if cfgs.image_encoder else None

    def transformer_for(self, t: float) -> WanTransformer:
        """The DiT that denoises at timestep t (Wan2.2-A14B switches experts at the boundary)."""
        if self.transformer_2 is None or t >= self.cfgs.boundary_ratio * 1000:
            return self.transformer
        return self.transformer_2


@dataclass
class WanAdapter(ModelAdapter):
    """Wan for `dtgen.build` (the whole of what the framework needs from this model)."""

    cfgs: WanConfigs
    vae_dtype: torch.dtype = torch.float32       # diffusers' examples decode in float32
    embedding_key: str = EMBEDDING_KEYS[0]       # which of the tied embedding's keys the checkpoint holds
    ignored_prefixes: tuple[str, ...] = ()
    image_encoder_prefix: str = ""               # CLIP keys' prefix in the checkpoint ("" or "vision_model.")

    def __post_init__(self):
        unread = next(k for k in EMBEDDING_KEYS if k != self.embedding_key)
        vae_unread = () if self.cfgs.image_to_video else tuple(f"vae.{p}" for p in IGNORED_CHECKPOINT_PREFIXES)
        # transformers' CLIP keeps its position ids as a buffer, which older writers saved
        clip_unread = (f"image_encoder.{self.image_encoder_prefix}embeddings.position_ids",)
        self.ignored_prefixes = vae_unread + (f"text_encoder.{unread}",) + clip_unread

    def build_on_meta(self) -> WanT2V:
        return WanT2V(self.cfgs)

    def _dits(self, model: WanT2V) -> list[tuple[str, WanTransformer]]:
        return [(c, getattr(model, c)) for c in ("transformer", "transformer_2") if getattr(model, c) is not None]

    def fp8_linears(self, model: WanT2V) -> list[str]:
        return [f"{component}.{p}" for component, _ in self._dits(model) for p in FP8_LINEARS]

    def fp8_attentions(self, model: WanT2V) -> tuple[list[nn.Module], int]:
        return [a for _, dit in self._dits(model) for a in dit.self_attentions()], self.cfgs.transformer.attention_head_dim

    def attention_heads(self, model: WanT2V) -> dict[str, tuple[int, int]]:
        heads = {}
        for component in ("transformer", "transformer_2"):
            dit = getattr(model, component)
            if dit is not None:   # the self-attention modules: those with a swappable core
                n = dit.cfg.num_attention_heads
                heads.update({f"{component}.{name}": (n, n) for name, m in dit.named_modules()
                              if isinstance(m, Attention) and hasattr(m, "core")})
        return heads

    def param_sources(self, model: WanT2V) -> dict[str, ParamSource]:
        sources = super().param_sources(model)
        sources["text_encoder.shared.weight"] = ParamSource((f"text_encoder.{self.embedding_key}",))
        for name in list(sources):
            if name.startswith("image_encoder."):
                sources[name] = ParamSource((f"image_encoder.{self.image_encoder_prefix}{name[14:]}",))
        return sources

    def lora_prefixes(self, model: WanT2V) -> dict[str, str]:
        return dict(LORA_PREFIXES)

    def unbuilt_modules(self, model: WanT2V) -> tuple[str, ...]:
        return (() if model.transformer_2 is not None else ("transformer_2.",)) + \
            (() if model.image_encoder is not None else ("image_encoder.",))

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        component, _, rest = name.partition(".")
        if component in ("vae", "image_encoder"):   # both float32 in diffusers' I2V examples
            return self.vae_dtype
        if component.startswith("transformer") and keeps_fp32(rest):
            return torch.float32
        return dtype


def load(checkpoint: str | Path, plan: Plan, rank: int = 0, world_size: int = 1,
         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *, vae_dtype: str = "float32",
         startup_timeout_s: float = 600.0, control_timeout_s: float = 60.0, dense_dtype: str = "model",
         attention_dtype: str = "model") -> Built:
    """A diffusers-format Wan checkpoint folder -> this rank's resident weights + controller.

    `dense_dtype` "fp8": the DiT blocks' linears (FP8_LINEARS) stored in e4m3, one scale per
    output channel, quantized as they are read (`dtgen.fp8`); "model" keeps them in `dtype`.
    `attention_dtype` "fp8": the DiT self-attention's dense part in FP8 (kernels/fp8_attention.py).
    Either one on a GPU without FP8 is refused before any weight is read."""
    vae = named_dtype(vae_dtype, "vae_dtype")
    cfgs = WanConfigs.from_folder(checkpoint)
    reader = ComponentsReader(checkpoint, cfgs.components)
    present = reader.parts["text_encoder"].keys()
    key = next((k for k in EMBEDDING_KEYS if k in present), None)
    if key is None:
        raise CheckpointError(f"{Path(checkpoint) / 'text_encoder'} holds neither of the token embedding keys "
                              f"{list(EMBEDDING_KEYS)}")
    tokenizer = load_tokenizer(Path(checkpoint) / "tokenizer")   # before any weight: a bad folder fails fast
    clip_keys = reader.parts["image_encoder"].keys() if cfgs.image_encoder is not None else ()
    clip_prefix = CHECKPOINT_PREFIX if any(k.startswith(CHECKPOINT_PREFIX) for k in clip_keys) else ""
    adapter = WanAdapter(cfgs, vae, key, image_encoder_prefix=clip_prefix)
    try:
        built = build(adapter, plan, reader, rank, world_size, dtype, device, startup_timeout_s=startup_timeout_s,
                      control_timeout_s=control_timeout_s, dense_dtype=dense_dtype, attention_dtype=attention_dtype)
    finally:
        reader.close()
    built.tokenizer = tokenizer
    return built

"""HunyuanImage3ForCausalMM: the whole text-to-image model as one plain module tree.

Top-level children carry the checkpoint's names (`model`, `lm_head`, `timestep_emb`,
`time_embed`, `time_embed_2`, `patch_embed`, `final_layer`, `vae`). The pipeline composes
the methods below; parallel runtimes bind weights and collectives around them without
changing this code.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.moe_dispatch import FP8_ONLY_IMPLS, experts_impl, experts_impl_fp8, moe_impl_problem

from dtgen.build import ParamSource
from dtgen.fp8 import swap_fp8_linears

from .config import HunyuanImage3Config
from .image_modules import FinalLayer, PatchEmbed, TimestepEmbedder
from .transformer import MoE, Experts, GatedMLP, HunyuanImage3Transformer, experts_eager
from .vae import HunyuanVAE
from .vision import AlignerConfig, VisionAligner, VisionConfig, VisionProcessorConfig, VisionTransformer


class HunyuanImage3ForCausalMM(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config, image_editing: bool = False):
        """`image_editing`: also build what reads a reference image (the VAE encoder, the
        SigLIP2 vision tower and its aligner); text-to-image never needs them."""
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.model = HunyuanImage3Transformer(cfg)
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.timestep_emb = TimestepEmbedder(H)
        self.time_embed = TimestepEmbedder(H)
        self.time_embed_2 = TimestepEmbedder(H)
        self.patch_embed = PatchEmbed(cfg.vae.latent_channels, cfg.patch_embed_hidden_dim, H)
        self.final_layer = FinalLayer(H, cfg.patch_embed_hidden_dim, cfg.vae.latent_channels)
        # Instruct-Distil: the guidance scale and the meanflow end time enter as tokens of
        # their own (plain None attributes otherwise: no parameters, no checkpoint keys).
        self.guidance_emb = TimestepEmbedder(H) if cfg.cfg_distilled else None
        self.timestep_r_emb = TimestepEmbedder(H) if cfg.use_meanflow else None
        self.vae = HunyuanVAE(cfg.vae, with_encoder=image_editing)
        # Plain None attributes when not editing: no parameters, so no checkpoint keys.
        self.vision_model = self.vision_aligner = self.vision_processor = None
        if image_editing:
            vit, aligner, processor = (cfg.raw.get(k) for k in ("vit", "vit_aligner", "vit_processor"))
            if not (vit and aligner and processor):
                raise ValueError("image editing needs the config's 'vit', 'vit_aligner' and 'vit_processor' "
                                 "sections; this checkpoint has none (a text-to-image-only checkpoint)")
            self.vision_model = VisionTransformer(VisionConfig.from_dict(vit))
            self.vision_aligner = VisionAligner(AlignerConfig.from_dict(aligner))
            self.vision_processor = VisionProcessorConfig.from_dict(processor)

    def unbuilt_modules(self) -> tuple[str, ...]:
        """Name prefixes of the modules this instance was built without (a plan's rules for
        them match nothing here)."""
        unbuilt = () if self.vision_model is not None else ("vision_model.", "vision_aligner.")
        unbuilt += () if self.guidance_emb is not None else ("guidance_emb.",)
        return unbuilt + (() if self.timestep_r_emb is not None else ("timestep_r_emb.",))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The decoder's activation dtype: the token embedding's (never stored in FP8, unlike
        the linears `--dense-dtype fp8` swaps); KV caches and conditions are kept in it."""
        return self.model.wte.weight.dtype

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.vision_model.embeddings.patch_embedding.weight.dtype

    # ---- pieces the pipeline composes ------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.wte(ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Text logits lm_head(ln_f(h)) in float32."""
        return self.lm_head(self.model.ln_f(h)).float()

    def image_tokens(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """patch_embed(latents, time_embed(t)): [B, C, h, w] -> [B, h*w, H]."""
        return self.patch_embed(latents, self.time_embed(t))

    def timestep_token(self, t: torch.Tensor) -> torch.Tensor:
        """The `<timestep>` slot's embedding: timestep_emb(t), [B, H]."""
        return self.timestep_emb(t)

    def step_tokens(self, t: torch.Tensor, guidance: torch.Tensor | None = None,
                    t_end: torch.Tensor | None = None) -> torch.Tensor:
        """The rows before the image that carry the step: [B, n, H], n = 1 (`<timestep>`) plus
        `<guidance>` (guidance_emb of the embedded guidance value) and `<timestep_r>`
        (timestep_r_emb of the step's end time) on a distilled checkpoint, in that order."""
        rows = [self.timestep_emb(t)]
        if self.guidance_emb is not None:
            rows.append(self.guidance_emb(guidance))
        if self.timestep_r_emb is not None:
            rows.append(self.timestep_r_emb(t_end))
        return torch.stack(rows, dim=1)

    def velocity(self, h_image: torch.Tensor, t: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """final_layer(last hidden at the image slots, time_embed_2(t)) -> [B, C, h, w] (no ln_f)."""
        return self.final_layer(h_image, self.time_embed_2(t), height, width)

    # ---- checkpoint layout -------------------------------------------------------------
    def param_sources(self) -> dict[str, ParamSource]:
        """Every parameter of this module tree and the official tensors that fill it."""
        sources = {}
        for name, _ in self.named_parameters():
            if name.endswith("mlp.experts.gate_and_up_proj") or name.endswith("mlp.experts.down_proj"):
                prefix, leaf = name.rsplit(".", 1)
                keys = tuple(f"{prefix}.{e}.{leaf}.weight" for e in range(self.cfg.num_experts))
                sources[name] = ParamSource(keys, stacked=True, micro_packed=True)
            elif name.endswith("mlp.experts.gate_and_up_scale") or name.endswith("mlp.experts.down_scale"):
                weight = name.replace("_scale", "_proj")
                sources[name] = ParamSource((), stacked=True, micro_packed=True, scale_of=weight)
            elif name.endswith("shared_mlp.gate_and_up_scale") or name.endswith("shared_mlp.down_scale"):
                weight = name.replace("_scale", "_proj")
                sources[name] = ParamSource((), micro_packed=name.endswith("gate_and_up_scale"), scale_of=weight)
            elif name.endswith("shared_mlp.gate_and_up_proj"):
                sources[name] = ParamSource((name + ".weight",), micro_packed=True)
            elif name.endswith("shared_mlp.down_proj"):
                sources[name] = ParamSource((name + ".weight",))
            else:
                sources[name] = ParamSource((name,))
        return sources


def use_fp8_experts(model: nn.Module) -> None:
    """Every MoE layer's routed experts in FP8 (scale parameters added; the loader fills them)."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.use_fp8()


# The dense linears `dense_dtype="fp8"` stores in e4m3 (one scale per output channel): every
# layer's QKV and O projections and its shared MLP (where the decoder's dense GEMMs are), and
# the lm_head (one vocabulary row a channel: the decode step's largest single read, 1.09 GB in
# bf16 against 0.55 GB). The router (float32), the embeddings and the image-side modules stay
# as they are.
FP8_ATTENTION_LINEARS = ("model.layers.*.self_attn.qkv_proj", "model.layers.*.self_attn.o_proj")
FP8_DENSE_LINEARS = FP8_ATTENTION_LINEARS + ("lm_head",)


def use_fp8_dense(model: nn.Module) -> None:
    """QKV, O, the shared MLP of every layer and the lm_head in FP8 (on meta; the loader
    quantizes them)."""
    swap_fp8_linears(model, FP8_DENSE_LINEARS)
    for name, module in model.named_modules():
        if isinstance(module, GatedMLP) and name.endswith("mlp.shared_mlp"):
            module.use_fp8()


def set_moe_impl(model: nn.Module, impl: str = "auto") -> None:
    """Pick the routed-experts implementation for every MoE layer: a name of
    `kernels.moe_dispatch.MOE_IMPLS` (its docstring says what each runs); "eager" is the
    plain loop in transformer.py. FP8 experts (`use_fp8_experts`) always run
    `experts_op_fp8` ("reference" forces its torch emulation); an FP8-only impl
    ("scaled_grouped_mm", "gluon") is refused for experts in the model dtype.
    """
    fn = None if impl in FP8_ONLY_IMPLS else experts_impl(impl, eager=experts_eager)
    for module in model.modules():
        if isinstance(module, Experts):
            if fn is None and module.gate_and_up_scale is None:
                raise ValueError(moe_impl_problem(impl, None))
            if fn is not None:
                module.impl = fn
            module.impl_fp8 = experts_impl_fp8(impl)


def set_moe_token_chunk(model: nn.Module, tokens: int | None) -> None:
    """Run every MoE layer's routed experts over at most `tokens` rows a call (None: all rows
    at once): a memory lever for long sequences (`MoE.token_chunk`)."""
    if tokens is not None and tokens < 1:
        raise ValueError(f"MoE token chunk must be at least 1 row, got {tokens}")
    for module in model.modules():
        if isinstance(module, MoE):
            module.token_chunk = tokens


# Checkpoint prefixes that text-to-image never uses: the SigLIP2 tower and its aligner
# (image conditioning), and the VAE encoder. They may be present; they are loaded only for
# image editing. The tower's pooling head is never used (HunyuanImage-3 reads the last
# hidden state).
EDITING_CHECKPOINT_PREFIXES = ("vision_model.", "vision_aligner.", "vae.encoder.")
NEVER_USED_CHECKPOINT_PREFIXES = ("vision_model.head.",)


def unused_checkpoint_prefixes(image_editing: bool) -> tuple[str, ...]:
    return NEVER_USED_CHECKPOINT_PREFIXES + (() if image_editing else EDITING_CHECKPOINT_PREFIXES)

"""The CLIP vision tower (transformers' `CLIPVisionModel`: Wan2.1-I2V's image encoder) as plain
modules, and its image preprocessing (transformers' CLIP image processor, from the folder's
`preprocessor_config.json`).

What image-to-video reads is the penultimate hidden state (WanImageToVideoPipeline's
`hidden_states[-2]`): the patch and class tokens after every encoder layer but the last, with
no post-layernorm; `CLIPVisionTower` runs exactly those layers. The last layer and the
post-layernorm are built all the same (the checkpoint holds them; they load by name), never run.

Parameter names are the `image_encoder/model.safetensors` keys as transformers 5 writes them
(older writers put all of them under `vision_model.`: `CHECKPOINT_PREFIX`, which a loader adds
where the checkpoint has it):
    embeddings.{class_embedding [D], patch_embedding.weight [D, 3, p, p] (no bias),
                position_embedding.weight [1 + (size / p)^2, D]}
    pre_layrnorm.{weight, bias}          (sic: transformers' spelling)
    encoder.layers.N.{layer_norm1, layer_norm2}.{weight, bias}
    encoder.layers.N.self_attn.{q,k,v,out}_proj.{weight, bias}
    encoder.layers.N.mlp.fc{1,2}.{weight, bias}
    post_layernorm.{weight, bias}
Pre-norm layers: x += out(attn(LN1(x))); x += fc2(act(fc1(LN2(x)))); attention scaled by
head_dim^-0.5, no mask; `hidden_act` "gelu" (erf; Wan's ViT-H/14) or "quick_gelu" (x * sigmoid(1.702 x)).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .config import JsonConfig, config_values
from .linear import Linear, empty_param

CHECKPOINT_PREFIX = "vision_model."
_ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass(frozen=True)
class CLIPVisionConfig(JsonConfig):
    """`image_encoder/config.json` (transformers' CLIPVisionConfig field names and defaults). Keys
    of transformers' generic config (dtype, architectures, ...) are not the tower's: not read."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_attention_heads: int = 12
    num_hidden_layers: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CLIPVisionConfig":
        if d.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"image encoder config: 'model_type'={d['model_type']!r}; expected a CLIPVisionModel's "
                             "'clip_vision_model'")
        kw = config_values(cls, d, "image encoder config", exclude={"raw"}, refuse_unknown=False)
        if kw.get("hidden_act", cls.hidden_act) not in _ACTIVATIONS:
            raise ValueError(f"image encoder config: 'hidden_act'={kw['hidden_act']!r} is not supported "
                             f"(one of {sorted(_ACTIVATIONS)})")
        if kw.get("num_hidden_layers", cls.num_hidden_layers) < 2:
            raise ValueError("image encoder config: 'num_hidden_layers' must be >= 2 (the penultimate layer's "
                             "output is the image features)")
        return cls(**kw, raw=dict(d))


class AffineNorm(nn.Module):
    """nn.LayerNorm's math under the checkpoint's names (weight, bias), in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim)
        self.bias = empty_param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                   self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.layer_norm1 = AffineNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm2 = AffineNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.mlp.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """`CLIPVisionModel`: pixel_values [B, 3, S, S]
    (`CLIPImagePreprocessor`'s) -> the penultimate layer's hidden states [B, 1 + (S / p)^2, D]."""

    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.cfg = cfg
        D, p = cfg.hidden_size, cfg.patch_size
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = empty_param(D)
        self.embeddings.patch_embedding = nn.Module()
        self.embeddings.patch_embedding.weight = empty_param(D, cfg.num_channels, p, p)
        self.embeddings.position_embedding = nn.Module()
        self.embeddings.position_embedding.weight = empty_param(1 + (cfg.image_size // p) ** 2, D)
        self.pre_layrnorm = AffineNorm(D, cfg.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = AffineNorm(D, cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings
        w = emb.patch_embedding.weight
        if tuple(pixel_values.shape[1:]) != (self.cfg.num_channels, self.cfg.image_size, self.cfg.image_size):
            c, size = self.cfg.num_channels, self.cfg.image_size
            raise ValueError(f"pixel values of shape {tuple(pixel_values.shape)}; expected [B, {c}, {size}, {size}]")
        patches = F.conv2d(pixel_values.to(w.dtype), w, stride=self.cfg.patch_size).flatten(2).transpose(1, 2)
        cls = emb.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + emb.position_embedding.weight
        x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[:-1]:   # hidden_states[-2]: all but the last layer
            x = layer(x)
        return x


@dataclass(frozen=True)
class CLIPImagePreprocessor(JsonConfig):
    """transformers' CLIP image processor as `image_processor/preprocessor_config.json` sets it
    (its PIL path, the one WanImageToVideoPipeline runs without torchvision): RGB, resize the
    shorter side to `size` (bicubic: resample 3), center crop to `crop_size`, x / 255, then
    (x - mean) / std per channel."""

    size: int = 224
    crop_height: int = 224
    crop_width: int = 224
    resample: int = 3
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CLIPImagePreprocessor":
        for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(key, True) is not True:
                raise ValueError(f"image processor config: '{key}'={d[key]!r} is not supported (CLIP's steps all run)")
        size, crop = d.get("size", cls.size), d.get("crop_size", cls.crop_height)
        if isinstance(size, dict):
            if set(size) != {"shortest_edge"}:
                raise ValueError(f"image processor config: 'size'={size!r}; only a shortest_edge resize is supported")
            size = size["shortest_edge"]
        crop_h, crop_w = (crop["height"], crop["width"]) if isinstance(crop, dict) else (crop, crop)
        return cls(int(size), int(crop_h), int(crop_w), int(d.get("resample", cls.resample)),
                   float(d.get("rescale_factor", cls.rescale_factor)),
                   tuple(d.get("image_mean", cls.image_mean)), tuple(d.get("image_std", cls.image_std)))

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """One PIL image -> pixel_values [1, 3, crop_height, crop_width] float32."""
        image = image.convert("RGB")
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(self.size * long / short)   # transformers' rounding (down)
        new_w, new_h = (self.size, new_long) if w <= h else (new_long, self.size)
        pixels = np.array(image.resize((new_w, new_h), resample=Image.Resampling(self.resample)))
        top, left = (new_h - self.crop_height) // 2, (new_w - self.crop_width) // 2
        pixels = pixels[top:top + self.crop_height, left:left + self.crop_width]
        x = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = (x - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[None]

"""The ViT half of the image-editing (TI2I) condition: SigLIP2 naflex tower, aligner, processor.

A reference image becomes `max_num_patches` tokens of the LLM sequence:

    uint8 image --vit_inputs--> patches [1, L, 3p^2] (+ mask, grid shape)
                --VisionTransformer--> last_hidden_state [1, L, D_vit]
                --VisionAligner--> [1, L, hidden]   (ALL L rows, padding included, are tokens)

Module and parameter names mirror the checkpoint, so a model holding a `VisionTransformer`
as `vision_model` and a `VisionAligner` as `vision_aligner` has exactly the checkpoint's
`vision_model.*` / `vision_aligner.*` keys. The official tower can also own a pooling
`head` (`vision_use_head`); HunyuanImage-3.0 only reads `last_hidden_state`, so no head is
built here and a loader must skip `vision_model.head.*` keys if a checkpoint has them.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The only activations these modules implement: the tower's MLP uses the tanh-approximate
# GELU, the aligner the exact (erf) one. Getting them swapped changes results at ~1e-4.
_TOWER_ACT = "gelu_pytorch_tanh"
_ALIGNER_TYPE = "mlp_gelu"
_ALIGNER_DEPTH = 2
_PIL_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, the processor's `resample` code


def _read_fields(cls, d: dict, what: str) -> dict:
    """The dataclass fields of `cls` taken from the official dict `d` (extra keys ignored)."""
    kwargs = {}
    for f in fields(cls):
        if d.get(f.name) is not None:
            kwargs[f.name] = d[f.name]
        elif f.default is MISSING:
            raise ValueError(f"{what} config is missing required field {f.name!r}")
    return kwargs


@dataclass(frozen=True)
class VisionConfig:
    """The official `vit` dict (SigLIP2 vision-config field names)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    num_channels: int
    patch_size: int
    num_patches: int  # size of the learned position table, a square grid resized per image
    hidden_act: str
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        kw = _read_fields(cls, d, "vit")
        if kw["hidden_act"] != _TOWER_ACT:
            raise ValueError(f"vit config hidden_act {kw['hidden_act']!r} is not supported; "
                             f"only {_TOWER_ACT!r} is implemented")
        ints = {k: int(v) for k, v in kw.items() if k not in ("hidden_act", "layer_norm_eps")}
        cfg = cls(hidden_act=kw["hidden_act"], layer_norm_eps=float(kw["layer_norm_eps"]), **ints)
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"vit config hidden_size {cfg.hidden_size} is not divisible by "
                             f"num_attention_heads {cfg.num_attention_heads}")
        if math.isqrt(cfg.num_patches) ** 2 != cfg.num_patches:
            raise ValueError(f"vit config num_patches {cfg.num_patches} is not a square (the position table "
                             f"is a square grid)")
        return cfg

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_patches)


@dataclass(frozen=True)
class AlignerConfig:
    """The official `vit_aligner` dict (HunyuanImage-3.0 `LightProjector`)."""

    projector_type: str
    input_dim: int
    n_embed: int
    depth: int

    @classmethod
    def from_dict(cls, d: dict) -> "AlignerConfig":
        kw = _read_fields(cls, d, "vit_aligner")
        if kw["projector_type"] != _ALIGNER_TYPE or int(kw["depth"]) != _ALIGNER_DEPTH:
            raise ValueError(f"vit_aligner projector_type {kw['projector_type']!r} depth {kw['depth']} is not "
                             f"supported; only {_ALIGNER_TYPE!r} with depth {_ALIGNER_DEPTH} is implemented")
        return cls(kw["projector_type"], int(kw["input_dim"]), int(kw["n_embed"]), int(kw["depth"]))


@dataclass(frozen=True)
class VisionProcessorConfig:
    """The official `vit_processor` dict (`Siglip2ImageProcessorFast` fields)."""

    patch_size: int
    max_num_patches: int
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, d: dict) -> "VisionProcessorConfig":
        # What the fast processor does with these switches off (no resize, raw 0..255
        # values, ...) is not what HunyuanImage-3.0 runs, so it is refused, not guessed.
        for switch in ("do_resize", "do_rescale", "do_normalize"):
            if d.get(switch, True) is False:
                raise ValueError(f"vit_processor {switch}=false is not supported; only the released setting "
                                 f"(true) is implemented")
        if d.get("resample") not in (None, _PIL_BILINEAR):
            raise ValueError(f"vit_processor resample {d['resample']!r} is not supported; only "
                             f"{_PIL_BILINEAR} (bilinear) is implemented")
        kw = _read_fields(cls, d, "vit_processor")

        def per_channel(value) -> tuple[float, ...]:  # HF also accepts one float for all channels
            return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),)

        return cls(patch_size=int(kw["patch_size"]), max_num_patches=int(kw["max_num_patches"]),
                   image_mean=per_channel(kw.get("image_mean", cls.image_mean)),
                   image_std=per_channel(kw.get("image_std", cls.image_std)),
                   rescale_factor=float(kw.get("rescale_factor", cls.rescale_factor)))

    def __call__(self, image_uint8: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return vit_inputs(image_uint8, self.patch_size, self.max_num_patches,
                          self.image_mean, self.image_std, self.rescale_factor)


# ----------------------------------------------------------------------------- processor

def target_size_for_max_patches(height: int, width: int, patch_size: int, max_num_patches: int,
                                eps: float = 1e-5) -> tuple[int, int]:
    """(H', W'), multiples of `patch_size`, for an image scaled to at most `max_num_patches` patches.

    The same bisection on the scale as the official `get_image_size_for_max_num_patches`
    (same bounds, same eps, Python floats), so the chosen size is identical; a closed form
    could pick a different size where ceil() jumps.
    """
    def side(scale: float, size: int) -> int:
        return max(patch_size, math.ceil(size * scale / patch_size) * patch_size)

    low, high = eps / 10, 100.0
    while high - low >= eps:
        mid = (low + high) / 2
        if (side(mid, height) / patch_size) * (side(mid, width) / patch_size) <= max_num_patches:
            low = mid
        else:
            high = mid
    return side(low, height), side(low, width)


def vit_inputs(image_uint8: Tensor, patch_size: int, max_num_patches: int,
               image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
               rescale_factor: float = 1 / 255) -> tuple[Tensor, Tensor, Tensor]:
    """uint8 [H, W, C] -> (pixel_values [1, L, p*p*C] f32, pixel_attention_mask [1, L] i64, spatial_shapes [1, 2] i64).

    L = max_num_patches. Real patches come first, row-major over the (rows, cols) patch
    grid; inside a patch the feature index is (py*p + px)*C + c. Rows past rows*cols are
    zero with mask 0.
    """
    if image_uint8.dtype != torch.uint8 or image_uint8.ndim != 3:
        raise ValueError(f"vit_inputs expects a uint8 [H, W, C] image, got {image_uint8.dtype} "
                         f"{list(image_uint8.shape)}")
    height, width, channels = image_uint8.shape
    if {len(image_mean), len(image_std)} - {1, channels}:
        raise ValueError(f"vit_inputs: image_mean/image_std need 1 or {channels} entries (one per channel), have "
                         f"{len(image_mean)}/{len(image_std)} entries")
    target_h, target_w = target_size_for_max_patches(height, width, patch_size, max_num_patches)
    # Contiguous CHW, as the processor holds it: a channels-last float input can take a
    # different interpolate kernel (and summation order).
    image = image_uint8.permute(2, 0, 1).contiguous()
    if (target_h, target_w) != (height, width):
        # torchvision resizes the processor's uint8 tensor either with torch's native uint8
        # kernel (CPUs whose capability string says "AVX2") or in float32 then round()
        # (AVX-512 CPUs, GPUs); the two differ by 1 level on ~10% of pixels. The float
        # path is the one the golden machine (AVX-512) and any GPU take, and it does not
        # depend on the host CPU. Bilinear weights are non-negative, so no clamp is needed.
        image = F.interpolate(image[None].float(), size=(target_h, target_w), mode="bilinear",
                              align_corners=False, antialias=True)[0].round().to(torch.uint8)
    # The fast processor fuses rescale into normalize: (u8 - mean/r) / (std/r) in float32,
    # mean/r computed as float32 tensor * (1/r). With mean = std = 0.5 this is
    # (u8 - 127.5) / 127.5, bit-exactly what it returns (x*r - mean would round differently).
    mean = (torch.tensor(image_mean, dtype=torch.float32) * (1.0 / rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(image_std, dtype=torch.float32) * (1.0 / rescale_factor)).view(-1, 1, 1)
    pixels = (image.float() - mean) / std

    rows, cols = target_h // patch_size, target_w // patch_size
    patches = (pixels.reshape(channels, rows, patch_size, cols, patch_size)
               .permute(1, 3, 2, 4, 0)
               .reshape(rows * cols, patch_size * patch_size * channels))
    pixel_values = torch.zeros(1, max_num_patches, patches.shape[1], dtype=torch.float32)
    pixel_values[0, :rows * cols] = patches
    mask = torch.zeros(1, max_num_patches, dtype=torch.int64)
    mask[0, :rows * cols] = 1
    return pixel_values, mask, torch.tensor([[rows, cols]], dtype=torch.int64)


# ----------------------------------------------------------------------------- tower

class VisionEmbeddings(nn.Module):
    """Linear patch embedding + the square position table resized to each image's patch grid."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.grid_side = cfg.position_grid_side
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def resized_positions(self, spatial_shapes: Tensor, length: int) -> Tensor:
        """[B, length, D]: table resized to (rows, cols) of each image, row-major; padding rows get row 0."""
        table = self.position_embedding.weight
        grid = table.reshape(self.grid_side, self.grid_side, -1).permute(2, 0, 1)[None]
        # Interpolated in float32: CPU has no antialiased bilinear kernel for bf16/fp16 (the
        # official code upcasts there too); the result is cast back to the table's dtype.
        grid = grid.float()
        out = table.new_empty(len(spatial_shapes), length, table.shape[1])
        for i, (rows, cols) in enumerate(spatial_shapes.tolist()):
            resized = F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=False, antialias=True)
            resized = resized.reshape(table.shape[1], rows * cols).T.to(table.dtype)
            out[i, :rows * cols] = resized
            # Padding rows are real tokens downstream (they enter the LLM sequence), so their
            # value matters: the official code gives them the first resized position.
            out[i, rows * cols:] = resized[0]
        return out

    def forward(self, pixel_values: Tensor, spatial_shapes: Tensor) -> Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches + self.resized_positions(spatial_shapes, pixel_values.shape[1])


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention with biases; padding keys are masked, padding queries are not."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        d = cfg.hidden_size
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        """x [B, L, D]; key_mask [B, 1, 1, L] bool, True = may be attended to."""
        b, length, d = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, length, self.num_heads, d // self.num_heads).transpose(1, 2)

        # SDPA's default scale is 1/sqrt(head_dim), as the official code; a boolean mask
        # gives exactly the official additive finfo.min mask (both make exp() exactly 0).
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, length, d))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionEncoderLayer(nn.Module):
    """Pre-LN block: x + attn(LN1(x)), then x + mlp(LN2(x))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


class VisionTransformer(nn.Module):
    """SigLIP2 naflex vision tower (official `Siglip2VisionTransformer` without the pooling head)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: Tensor, pixel_attention_mask: Tensor, spatial_shapes: Tensor) -> Tensor:
        """pixel_values [B, L, C*p*p], pixel_attention_mask [B, L], spatial_shapes [B, 2] -> [B, L, D]."""
        b, length, features = pixel_values.shape
        expected = self.cfg.num_channels * self.cfg.patch_size ** 2
        if features != expected or pixel_attention_mask.shape != (b, length) or spatial_shapes.shape != (b, 2):
            raise ValueError(f"vision tower inputs: pixel_values {list(pixel_values.shape)} (last dim must be "
                             f"{expected}), pixel_attention_mask {list(pixel_attention_mask.shape)}, "
                             f"spatial_shapes {list(spatial_shapes.shape)} do not fit together")
        key_mask = pixel_attention_mask.bool()[:, None, None, :]
        hidden = self.encoder(self.embeddings(pixel_values, spatial_shapes), key_mask)
        return self.post_layernorm(hidden)


class VisionAligner(nn.Module):
    """`mlp_gelu` projector: Linear(D_vit -> n_embed), exact GELU, Linear(n_embed -> n_embed)."""

    def __init__(self, cfg: AlignerConfig):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg.input_dim, cfg.n_embed), nn.GELU(),
                                    nn.Linear(cfg.n_embed, cfg.n_embed))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

"""The Wan DiT (models/wan/transformer.py) against diffusers' WanTransformer3DModel, CPU, tiny configs."""
import pytest
import torch

from dtgen.attention import AttentionMeta
from models.wan.transformer import WanTransformerConfig
from models.wan.transformer import WanTransformer, full_sequence_meta, keeps_fp32

# Two tiny variants: (1, 2, 2) patches with the cross-attention norm (Wan 2.1 / 2.2 layout), and
# (2, 2, 2) patches without it, head_dim 24 (RoPE split 8/8/8) and out_channels != in_channels.
CFG_A = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
             out_channels=4, text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True)
CFG_B = dict(patch_size=(2, 2, 2), num_attention_heads=4, attention_head_dim=24, in_channels=4,
             out_channels=6, text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2, cross_attn_norm=False)


def _pair(cfg: dict):
    """A diffusers model with perturbed random weights and ours loaded from its state dict."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():  # move norm weights off 1 and biases off their init
            p.add_(0.05 * torch.randn_like(p))
    ours = WanTransformer(WanTransformerConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _inputs(cfg: dict, B: int, F: int, H: int, W: int, L: int = 7, per_token_t: bool = False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, cfg["in_channels"], F, H, W, generator=g)
    p = cfg["patch_size"]
    S = (F // p[0]) * (H // p[1]) * (W // p[2])
    t = torch.rand((B, S) if per_token_t else (B,), generator=g) * 1000
    text = torch.randn(B, L, cfg["text_dim"], generator=g)
    return x, t, text


@torch.no_grad()
def test_the_split_points_are_embeds_token_rows():
    """WanTransformer.seq_splits (dtgen/seq_split.py) names fields `embed` returns, each split
    along its token rows (45, per-token timesteps); the text stays whole for the cross-attention."""
    ours = WanTransformer(WanTransformerConfig.from_dict(CFG_A)).eval()   # its weights unset: shapes only
    e = ours.embed(*_inputs(CFG_A, 1, 3, 6, 10, per_token_t=True))
    splits = WanTransformer.seq_splits
    for name, how in splits.inputs.items():
        value = getattr(e, name)
        assert all(v.shape[how.dim] == 45 for v in (value if isinstance(value, tuple) else (value,))), name
    assert "text" not in splits.inputs and splits.attention == ("tokens",)


@pytest.mark.parametrize("cfg, shape, per_token_t", [
    (CFG_A, (2, 3, 8, 8), False),    # 48 tokens
    (CFG_A, (1, 3, 6, 10), True),    # 45 tokens (odd), per-token timesteps (Wan 2.2 TI2V-5B)
    (CFG_B, (2, 4, 6, 6), False),    # 18 tokens, (2, 2, 2) patches
])
@torch.no_grad()
def test_forward_matches_diffusers(cfg, shape, per_token_t):
    ref, ours = _pair(cfg)
    x, t, text = _inputs(cfg, *shape, per_token_t=per_token_t)
    want = ref(x, t, text, return_dict=False)[0]
    got = ours(x, t, text)
    assert got.shape == want.shape == (shape[0], cfg["out_channels"], *shape[1:])
    err = (got - want).abs().max().item()
    assert err < 1e-5 * want.abs().max().item(), err


@torch.no_grad()
def test_bf16_tracks_diffusers():
    """bf16 with diffusers' float32 modules kept float32: the same numerics, not just close."""
    ref, ours = _pair(CFG_A)
    for name, p in ref.named_parameters():  # not ref.to(): that would also round its RoPE buffers
        if not keeps_fp32(name):
            p.data = p.data.bfloat16()
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    x, t, text = _inputs(CFG_A, 1, 3, 6, 10)
    want = ref(x.bfloat16(), t, text.bfloat16(), return_dict=False)[0]
    got = ours(x.bfloat16(), t, text.bfloat16())
    assert got.dtype == torch.bfloat16
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-3 * want.float().abs().max().item(), err  # measured: bitwise equal on CPU


@torch.no_grad()
@pytest.mark.parametrize("per_token_t", [False, True])
def test_padding_rows_do_not_change_real_rows(per_token_t):
    """Zero padding rows after the patch tokens (sequence-parallel tail padding) with the padded
    meta: the real rows' block outputs are those of the unpadded run."""
    torch.manual_seed(0)
    model = WanTransformer(WanTransformerConfig.from_dict(CFG_A)).eval()
    for p in model.parameters():
        p.copy_(0.2 * torch.randn_like(p))
    x, t, text = _inputs(CFG_A, 2, 3, 6, 10, per_token_t=per_token_t)
    e = model.embed(x, t, text)
    S, pad = e.tokens.shape[1], 7
    want = model.blocks_forward(e.tokens, e.temb_proj, e.text, e.rope)

    def rows(a, value):  # pad dim 1 (dim 0 for the rope tables) with `pad` rows
        dim = 0 if a.ndim == 2 else 1
        extra = list(a.shape)
        extra[dim] = pad
        return torch.cat([a, torch.full(extra, value, dtype=a.dtype)], dim=dim)

    tokens = rows(e.tokens, 0.0)
    temb_proj = rows(e.temb_proj, 0.0) if per_token_t else e.temb_proj
    rope = (rows(e.rope[0], 0.3), rows(e.rope[1], -0.7))  # arbitrary: padding rows are per-row only
    for meta in (full_sequence_meta(S + pad, S),  # static runs: dense real rows + masked padding rows
                 AttentionMeta(slots=torch.arange(S + pad), image_blocks=((0, S),))):  # mask only
        got = model.blocks_forward(tokens, temb_proj, e.text, rope, meta)
        assert torch.isfinite(got).all()
        assert (got[:, :S] - want).abs().max().item() < 1e-5


def test_config_refuses_unsupported_variants():
    for key, value in (("image_dim", 1280), ("added_kv_proj_dim", 5120), ("qk_norm", "rms_norm"),
                       ("window_size", [-1, -1])):
        with pytest.raises(ValueError, match=key) as info:
            WanTransformerConfig.from_dict({**CFG_A, key: value})
        assert "\n" not in str(info.value)
    cfg = WanTransformerConfig.from_dict({**CFG_A, "out_channels": None, "image_dim": None, "_class_name": "x"})
    assert cfg.out_channels == cfg.in_channels and cfg.patch_size == (1, 2, 2)


@pytest.mark.parametrize("cfg", [CFG_A, CFG_B])
def test_parameter_names_equal_diffusers_keys(cfg):
    diffusers = pytest.importorskip("diffusers")
    want = {k: tuple(v.shape) for k, v in diffusers.WanTransformer3DModel(**cfg).state_dict().items()}
    with torch.device("meta"):  # how the loader builds it
        ours = WanTransformer(WanTransformerConfig.from_dict(cfg))
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert dict(ours.named_parameters()).keys() == got.keys()  # no buffers

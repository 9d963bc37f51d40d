"""The Wan image-to-video DiT (models/wan/transformer.py with image tokens and condition channels)
against diffusers' WanTransformer3DModel, CPU, float32, tiny configs."""
import pytest
import torch

from models.wan.transformer import WanTransformer, WanTransformerConfig

# Wan2.1-I2V's layout at tiny widths: 4 + 1 + 4 input channels (noise, mask, condition latents,
# as 16 + 4 + 16 in the checkpoint; the DiT only sees their sum), CLIP features of width 12.
CFG_I2V = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=9, out_channels=4,
               text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, image_dim=12,
               added_kv_proj_dim=32)


def _pair(cfg: dict):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():  # move norm weights off 1 and biases off their init
            p.add_(0.05 * torch.randn_like(p))
    ours = WanTransformer(WanTransformerConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_forward_with_image_tokens_matches_diffusers(batch):
    """diffusers concatenates [image, text] rows and splits them again at 512 text rows; the text
    here is 512 rows so that its split is the real one."""
    ref, ours = _pair(CFG_I2V)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 9, 3, 6, 8, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    text = torch.randn(batch, 512, 24, generator=g)
    image = torch.randn(batch, 5, 12, generator=g)
    want = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
    got = ours(x, t, text, image)
    assert got.shape == want.shape == (batch, 4, 3, 6, 8)
    err = (got - want).abs().max().item()
    assert err < 1e-5 * want.abs().max().item(), err


@torch.no_grad()
def test_condition_channels_without_image_tokens_match_diffusers():
    """Wan2.2-I2V-A14B's experts: the condition on the input channels, no image tokens."""
    cfg = {**CFG_I2V, "image_dim": None, "added_kv_proj_dim": None}
    ref, ours = _pair(cfg)
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(2, 9, 2, 4, 4, generator=g), torch.tensor([900.0, 10.0])
    text = torch.randn(2, 7, 24, generator=g)
    want = ref(x, t, text, return_dict=False)[0]
    assert (ours(x, t, text) - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_parameter_names_equal_diffusers_keys():
    diffusers = pytest.importorskip("diffusers")
    want = {k: tuple(v.shape) for k, v in diffusers.WanTransformer3DModel(**CFG_I2V).state_dict().items()}
    with torch.device("meta"):
        ours = WanTransformer(WanTransformerConfig.from_dict(CFG_I2V))
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == want


def test_image_tokens_are_required_exactly_where_the_dit_has_them():
    with torch.device("meta"):
        i2v = WanTransformer(WanTransformerConfig.from_dict(CFG_I2V))
        t2v = WanTransformer(WanTransformerConfig.from_dict({**CFG_I2V, "image_dim": None, "added_kv_proj_dim": None}))
    x, t, text, image = torch.zeros(1, 9, 1, 2, 2), torch.zeros(1), torch.zeros(1, 3, 24), torch.zeros(1, 2, 12)
    with pytest.raises(ValueError, match="required"):
        i2v.embed(x, t, text)
    with pytest.raises(ValueError, match="not taken"):
        t2v.embed(x, t, text, image)


def test_config_refuses_half_an_image_branch_and_flf2v_positions():
    for extra, key in (({"image_dim": None}, "added_kv_proj_dim"), ({"pos_embed_seq_len": 514}, "pos_embed_seq_len")):
        with pytest.raises(ValueError, match=key) as info:
            WanTransformerConfig.from_dict({**CFG_I2V, **extra})
        assert "\n" not in str(info.value)

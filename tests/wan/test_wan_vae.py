"""Wan VAE decode (dtgen/layers/wan_vae.py) against diffusers ``AutoencoderKLWan``, and its spatially
split decode (dtgen/layers/wan_vae_parallel.py) on 2 gloo ranks against the single-process decode.

Tiny random config (decoder widths 32/32/16/8, one residual block + 1 per level, the real
16-channel latent statistics), CPU fp32. Tolerance atol = rtol = 1e-5: the same windows are
computed, only convolution algorithms and summation orders differ (measured max abs
deviation ~4e-6 from diffusers, ~3e-6 split vs unsplit, on outputs of magnitude ~1; a naive
split misses by > 1e-2, ``test_naive_split_is_far_off``). Norm gammas are randomized so the
checkpoint's norm weights are exercised.
"""
import pytest
import torch

from dtgen.launch import RankPool
from dtgen.layers.wan_vae import IGNORED_CHECKPOINT_PREFIXES, WanVAE, WanVAEConfig, unnormalize_latents
from dtgen.layers.wan_vae_parallel import ParallelWanVAE, parallel_decode

TOL = {"atol": 1e-5, "rtol": 1e-5}
TINY = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
        "temperal_downsample": [False, True, True]}

_STATE = {}  # per rank process: the VAE, made by job_setup


def _latents(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _randomize_gammas(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))


def _random_vae(seed=0):
    torch.manual_seed(seed)
    vae = WanVAE(WanVAEConfig.from_dict(TINY)).eval()
    _randomize_gammas(vae, seed)
    return vae


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These convolutions are tiny: with 2 intra-op threads on a busy 2-core machine a decode
    spent ~15x the CPU time of one thread (measured 1.6 s vs 0.11 s), so this module runs on
    one thread (as the RankPool ranks do) and restores the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _check(actual, expected, what):
    dev = (actual - expected).abs().max().item()
    print(f"{what}: max abs deviation {dev:.3e} (max |ref| {expected.abs().max().item():.3f})")
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")
    return dev


# ---- diffusers parity ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(**TINY).eval()
    _randomize_gammas(ref, 0)
    return ref


@pytest.fixture(scope="module")
def ported(reference):
    vae = WanVAE(WanVAEConfig.from_dict(dict(reference.config))).eval()
    result = vae.load_state_dict(reference.state_dict(), strict=False)
    assert not result.missing_keys
    assert all(k.startswith(IGNORED_CHECKPOINT_PREFIXES) for k in result.unexpected_keys)
    return vae


def test_state_dict_equals_diffusers_decode_keys(reference):
    cfg = WanVAEConfig.from_dict(dict(reference.config))
    with torch.device("meta"):  # how the loader builds it
        vae = WanVAE(cfg)
    ours = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items()
              if not k.startswith(IGNORED_CHECKPOINT_PREFIXES)}
    assert ours == theirs
    assert all(k.startswith(("post_quant_conv.", "decoder.")) for k in ours)
    assert all(p.is_meta for p in vae.parameters())


def _diffusers_decode(ref, latents):
    """WanPipeline's last step: cast, un-normalize with the config's statistics, decode."""
    latents = latents.to(ref.dtype)
    mean = torch.tensor(ref.config.latents_mean).view(1, ref.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(ref.config.latents_std).view(1, ref.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype)
    return ref.decode(latents / inv_std + mean, return_dict=False)[0]


@pytest.mark.parametrize("shape,whole", [((1, 16, 2, 4, 6), False), ((2, 16, 3, 3, 5), True)])
@torch.no_grad()
def test_decode_matches_diffusers(reference, ported, shape, whole):
    """Frame by frame (diffusers' order) and, for 3 latent frames, all frames in one pass."""
    latents = _latents(shape, seed=shape[2])
    expected = _diffusers_decode(reference, latents)
    b, _, t, h, w = shape
    assert expected.shape == (b, 3, 1 + 4 * (t - 1), 8 * h, 8 * w)
    assert ported.cfg.num_frames(t) == expected.shape[2]
    _check(ported.decode(latents), expected, f"decode {shape}, one latent frame per chunk")
    if whole:
        _check(ported.decode(latents, chunk_frames=t), expected, f"decode {shape}, one chunk")
        _check(ported.decode(latents, chunk_frames=2), expected, f"decode {shape}, chunks of 2")
    assert expected.abs().max() <= 1.0


def test_unnormalize_is_the_pipeline_formula():
    cfg = WanVAEConfig()
    x = _latents((1, 16, 1, 2, 2))
    mean = torch.tensor(cfg.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(unnormalize_latents(x, cfg.latents_mean, cfg.latents_std), x * std + mean)


def test_config_checks():
    assert WanVAEConfig.from_dict({"_class_name": "AutoencoderKLWan", **TINY}).num_frames(21) == 81
    with pytest.raises(ValueError, match="unknown key"):
        WanVAEConfig.from_dict({"zdim": 16})
    with pytest.raises(ValueError, match="Wan 2.2 VAE"):
        WanVAEConfig.from_dict({"z_dim": 48, "is_residual": True, "patch_size": 2,
                                "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48})


# ---- spatially split decode on 2 gloo ranks --------------------------------------------------
UNEVEN = {"height": (1, 16, 2, 5, 4), "width": (1, 16, 3, 3, 7)}  # 5 -> 3,2 rows; 7 -> 4,3 columns


def job_setup(ctx, vae):
    _STATE["vae"] = vae
    return True


@torch.no_grad()
def job_decode(ctx, latents, dim, exchange):
    return parallel_decode(_STATE["vae"], latents, dim=dim, exchange=exchange)


@torch.no_grad()
def job_decode_outputs(ctx, latents):
    pvae = ParallelWanVAE(_STATE["vae"], None, "height")
    return {"local": pvae.decode(latents, output="local"), "rows": pvae.video_rows(latents),
            "dst1": pvae.decode(latents, output=1, chunk_frames=2),
            "kinds": sorted({type(m).__name__ for m in pvae.twin(pvae.split_for(latents)).modules()})}


@pytest.fixture(scope="module")
def split_vae():
    return _random_vae(seed=1)


@pytest.fixture(scope="module")
def pool(split_vae):
    with RankPool(2, timeout_s=60) as p:
        p.run(job_setup, split_vae)
        yield p


@pytest.mark.parametrize("dim,exchange", [("height", "p2p"), ("width", "allgather")])
@torch.no_grad()
def test_split_decode_equals_single_process(pool, split_vae, dim, exchange):
    latents = _latents(UNEVEN[dim], seed=2)
    ref = split_vae.decode(latents)
    for rank, video in enumerate(pool.run(job_decode, latents, dim, exchange)):
        _check(video, ref, f"uneven {dim} split over 2 ({exchange}), rank {rank}")


@torch.no_grad()
def test_split_decode_of_a_batch_equals_each_video_alone(pool, split_vae):
    """A batch's decode (the pipelines decode a batch's small videos in one call) split over 2: each
    video of the batch as the single process decodes it alone."""
    latents = torch.cat([_latents(UNEVEN["height"], seed=4), _latents(UNEVEN["height"], seed=5)])
    for rank, video in enumerate(pool.run(job_decode, latents, "height", "p2p")):
        for k in range(2):
            _check(video[k:k + 1], split_vae.decode(latents[k:k + 1]), f"video {k} of 2, rank {rank}")


@torch.no_grad()
def test_split_output_modes(pool, split_vae):
    """output="local": each rank's rows (3 and 2 latent rows); output=1: the video on rank 1
    only (decoded two latent frames per chunk)."""
    latents = _latents(UNEVEN["height"], seed=3)
    ref = split_vae.decode(latents)
    results = pool.run(job_decode_outputs, latents)
    assert [r["rows"] for r in results] == [(0, 24), (24, 16)]
    for rank, r in enumerate(results):
        off, n = r["rows"]
        _check(r["local"], ref[..., off:off + n, :], f"local rows, rank {rank}")
        if rank == 1:
            _check(r["dst1"], ref, "video gathered on rank 1")
        else:
            assert r["dst1"] is None
        assert {"HaloConv", "ParallelAttentionBlock", "ChannelRMSNorm"} <= set(r["kinds"])


@torch.no_grad()
def test_naive_split_is_far_off(split_vae):
    """Decoding each latent half on its own (no halos, per-half attention) is far outside the
    tolerance, so the split tests above can fail."""
    latents = _latents(UNEVEN["height"], seed=2)
    naive = torch.cat([split_vae.decode(half) for half in latents.tensor_split(2, dim=-2)], dim=-2)
    assert (naive - split_vae.decode(latents)).abs().max() > 1e-2

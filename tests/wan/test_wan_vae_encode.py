"""The Wan VAE's encode path (dtgen/layers/wan_vae.py: WanEncoder, quant_conv, the normalization
WanImageToVideoPipeline applies) against diffusers ``AutoencoderKLWan``, CPU float32, tiny config."""
import pytest
import torch

from dtgen.layers.wan_vae import WanVAE, WanVAEConfig

TINY = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
        "temperal_downsample": [False, True, True]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny convolutions on a busy 2-core machine: one intra-op thread is several times faster
    than two (as tests/wan/test_wan_vae.py measures); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(**TINY).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ref.named_parameters():   # norm gammas off 1: the checkpoint's norm weights count
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    ours = WanVAE(WanVAEConfig.from_dict(dict(ref.config)), encoder=True).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.mark.parametrize("frames", [1, 9])
@torch.no_grad()
def test_encode_matches_diffusers(pair, frames):
    """The I2V condition's shape of input: the reference frame, then zero frames (9: three chunks,
    both temporal downsamplers' carried frames)."""
    ref, ours = pair
    g = torch.Generator().manual_seed(frames)
    video = torch.zeros(1, 3, frames, 32, 48)
    video[:, :, 0] = torch.rand(1, 3, 32, 48, generator=g) * 2 - 1
    if frames > 1:   # non-zero later frames too: the time convs must carry real context
        video[:, :, 3] = torch.rand(1, 3, 32, 48, generator=g) * 2 - 1
    z = ref.encode(video).latent_dist.mode()
    cfg = ref.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    want = (z - mean) * inv_std
    got = ours.encode(video)
    assert got.shape == want.shape == (1, 16, 1 + (frames - 1) // 4, 4, 6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_encode_refuses_a_frame_count_off_the_chunks(pair):
    with pytest.raises(ValueError, match="4k \\+ 1"):
        pair[1].encode(torch.zeros(1, 3, 4, 16, 16))


# ---- the encode split over 2 gloo ranks ---------------------------------------------------------
def job_parallel_encode(ctx, state, video, dim):
    torch.set_num_threads(1)
    from dtgen.layers.wan_vae_parallel import parallel_encode
    vae = WanVAE(WanVAEConfig.from_dict(TINY), encoder=True).eval()
    vae.load_state_dict(state)
    with torch.no_grad():
        return parallel_encode(vae, video, None, dim)


@pytest.mark.parametrize("dim, size", [("height", (40, 24)), ("width", (16, 48))],
                         ids=["height-uneven", "width-even"])
def test_split_encode_matches_one_process(pair, dim, size):
    """The condition's encode split by latent rows over 2 ranks (5 latent rows: 3 + 2) gives the
    single process's latents on every rank."""
    from dtgen.launch import RankPool
    _, ours = pair
    g = torch.Generator().manual_seed(4)
    video = torch.zeros(1, 3, 5, *size)
    video[:, :, 0] = torch.rand(1, 3, *size, generator=g) * 2 - 1
    video[:, :, 2] = torch.rand(1, 3, *size, generator=g) * 2 - 1
    with torch.no_grad():
        want = ours.encode(video)
    with RankPool(2, timeout_s=120) as pool:
        for rank, got in enumerate(pool.run(job_parallel_encode, ours.state_dict(), video, dim)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {rank}: {m}")

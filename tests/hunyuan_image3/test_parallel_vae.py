"""Spatially split VAE decode (dtgen/spatial.py, models/hunyuan_image3/parallel_vae.py) on 4 gloo ranks.

Every parallel result is compared with the unsplit single-process module, on every rank
(edge ranks included). Tolerance, fp32: atol = rtol = 1e-5. The halo conv sees exactly the
unsplit conv's input windows and the attention the same keys; only summation orders differ
(GroupNorm moments combined across ranks, SDPA over a different query blocking), which
moves results by a few 1e-7 relative per layer; measured max abs deviation of a full decode
is ~3e-6 on outputs of magnitude ~1. ``test_naive_split_is_far_off`` shows the tolerance is
sharp: decoding slices independently misses by > 1e-2.

One spawned group of 4 ranks serves the module; a setup job loads the tiny VAE once per rank
and builds the 2-rank subgroups ({0, 1}, {2, 3}) with ``dist.new_group`` on every rank. Jobs
that expect an error catch it and return the message, so the group stays healthy.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtgen.launch import RankPool
from dtgen.spatial import (DistGroupNorm, HaloConv, SpatialSplit, check_halo_conv, combine_moments,
                           group_moments, split_sizes)
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.parallel_vae import ParallelVAE, parallel_decode
from placements.hunyuan_image3 import get_plan

TOL = {"atol": 1e-5, "rtol": 1e-5}
# Latent shapes per split direction: the split extent divides by 2 and by 4.
LATENT = {"height": (1, 32, 4, 6), "width": (1, 32, 8, 4)}
UNEVEN = (2, 32, 5, 7)  # height 5 over 4 ranks: 2,1,1,1; width 7: 2,2,2,1; over 2: 3,2 / 4,3

_STATE = {}  # per rank process: the VAE and the subgroups, made by job_setup


def _latents(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _group(size):
    return _STATE["pair"] if size == 2 else None  # None: the default 4-rank group


def _vae(ckpt):
    return load(ckpt, get_plan("single")).model.vae.eval()


# ---- jobs (run on every rank) --------------------------------------------------------------
def job_setup(ctx, ckpt):
    _STATE["vae"] = _vae(ckpt)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    _STATE["pair"] = pairs[ctx.rank // 2]
    return True


@torch.no_grad()
def job_decode(ctx, latents, dim, size, exchange="p2p"):
    return parallel_decode(_STATE["vae"], latents, _group(size), dim=dim, exchange=exchange)


@torch.no_grad()
def job_decode_outputs(ctx, latents, dim):
    pvae = ParallelVAE(_STATE["vae"], None, dim)
    return {"local": pvae.decode(latents, output="local"), "rows": pvae.image_rows(latents),
            "dst2": pvae.decode(latents, output=2), "frames": pvae.decode_all_frames(latents)}


@torch.no_grad()
def job_halo_conv(ctx, conv, x, dim, size, exchange):
    group = _group(size)
    split = SpatialSplit.build(group, dim, x.shape[dim])
    return HaloConv(conv, split, exchange)(split.local(x))


@torch.no_grad()
def job_group_norm(ctx, norm, x, dim, size):
    split = SpatialSplit.build(_group(size), dim, x.shape[dim])
    return DistGroupNorm(norm, split)(split.local(x))


def _tree(module):
    """Every module by name with its identity, child table identity and parameter pointers."""
    return [(name, id(m), id(m._modules), {k: (id(p), p.data_ptr()) for k, p in m._parameters.items()})
            for name, m in module.named_modules()]


@torch.no_grad()
def job_no_copy(ctx, latents):
    vae = _STATE["vae"]
    before = _tree(vae)
    pvae = ParallelVAE(vae, None, "height")
    twin = pvae.twin(pvae.split_for(latents))
    twin_params = {id(p): p.data_ptr() for p in twin.parameters()}
    orig_params = {id(p): p.data_ptr() for p in vae.parameters()}
    image = pvae.decode(latents)
    after_call = _tree(vae)
    try:  # 16 latent channels: conv_in fails inside the twin, on every rank alike
        pvae.decode(latents[:, :16])
        error = None
    except RuntimeError as e:
        error = str(e)
    after_error = _tree(vae)
    return {"same_params": twin_params == orig_params, "before": before, "after_call": after_call,
            "after_error": after_error, "error": error, "image": image,
            "twin_kinds": sorted({type(m).__name__ for m in twin.modules()})}


def job_bad_split(ctx, latents, dim, size, output="all"):
    try:
        parallel_decode(_STATE["vae"], latents, _group(size), dim=dim, output=output)
    except ValueError as e:
        return str(e)
    return None


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tiny_checkpoint):
    with RankPool(4, timeout_s=90) as p:
        p.run(job_setup, tiny_checkpoint)
        yield p


@pytest.fixture(scope="module")
def vae(tiny_checkpoint):
    return _vae(tiny_checkpoint)


def _check(actual, expected, what):
    dev = (actual - expected).abs().max().item()
    print(f"{what}: max abs deviation {dev:.3e} (max |ref| {expected.abs().max().item():.3f})")
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")
    return dev


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dim", ["height", "width"])
@torch.no_grad()
def test_decode_equals_single_process(pool, vae, dim, size):
    latents = _latents(LATENT[dim])
    ref = vae.decode(latents)
    for rank, image in enumerate(pool.run(job_decode, latents, dim, size)):
        _check(image, ref, f"{dim} split over {size}, rank {rank}")


@pytest.mark.parametrize("dim,size,exchange", [("height", 4, "p2p"), ("width", 4, "allgather"),
                                               ("width", 2, "p2p")])
@torch.no_grad()
def test_uneven_split_equals_single_process(pool, vae, dim, size, exchange):
    latents = _latents(UNEVEN, seed=1)
    ref = vae.decode(latents)
    for rank, image in enumerate(pool.run(job_decode, latents, dim, size, exchange)):
        _check(image, ref, f"uneven {dim} over {size} ({exchange}), rank {rank}")


@torch.no_grad()
def test_output_modes(pool, vae):
    """output="local" gives each rank its rows (uneven here), output=2 the full image on group
    rank 2 only, decode_all_frames every frame."""
    latents = _latents((1, 32, 6, 4), seed=2)  # height 6 over 4: 2,2,1,1 latent rows
    ref_frames = vae.decode_all_frames(latents)
    ref = ref_frames[:, :, -1]
    results = pool.run(job_decode_outputs, latents, "height")
    assert [r["rows"] for r in results] == [(0, 32), (32, 32), (64, 16), (80, 16)]
    for rank, r in enumerate(results):
        off, n = r["rows"]
        _check(r["local"], ref[:, :, off:off + n], f"local rows, rank {rank}")
        _check(r["frames"], ref_frames, f"all frames, rank {rank}")
        if rank == 2:
            _check(r["dst2"], ref, "image gathered on rank 2")
        else:
            assert r["dst2"] is None


@pytest.mark.parametrize("kind", ["k3", "k5", "k3-dilated", "k1", "conv2d"])
@pytest.mark.parametrize("dim", [-2, -1])
@torch.no_grad()
def test_halo_conv_matches_unsplit(pool, kind, dim):
    torch.manual_seed(0)
    if kind == "conv2d":
        conv, x = nn.Conv2d(6, 5, (3, 5), padding=(1, 2)), torch.randn(2, 6, 10, 11)
    else:
        k, d = {"k3": (3, 1), "k5": (5, 1), "k3-dilated": (3, 2), "k1": (1, 1)}[kind]
        conv, x = nn.Conv3d(6, 5, k, padding=d * (k - 1) // 2, dilation=d), torch.randn(2, 6, 2, 10, 11)
    ref = conv(x)
    for size, exchange in [(4, "p2p"), (4, "allgather"), (2, "p2p")]:
        sizes = split_sizes(x.shape[dim], size)  # 10 -> 3,3,2,2; 11 -> 3,3,3,2
        outs = pool.run(job_halo_conv, conv, x, dim, size, exchange)
        for rank, out in enumerate(outs):
            r = rank % size
            expected = ref.narrow(dim, sum(sizes[:r]), sizes[r])
            torch.testing.assert_close(out, expected, **TOL, msg=lambda m: f"{kind} {exchange} rank {rank}: {m}")


@pytest.mark.parametrize("dim", [-2, -1])
@torch.no_grad()
def test_group_norm_matches_unsplit(pool, dim):
    """Whole-image statistics equal the unsplit GroupNorm's (offset 0: within 1e-5). With a
    large common offset (mean 100, std ~1) fp32 itself is the limit (the unsplit kernel is
    ~1.3e-5 off the fp64 result there): the split norm must be no further from fp64 than 2x
    the unsplit one, which a sum / sum-of-squares formula (~1.7e-3 off) would fail."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(4, 8, eps=1e-6)
    nn.init.normal_(norm.weight, 1.0, 0.2)
    nn.init.normal_(norm.bias, 0.0, 0.2)
    norm64 = copy.deepcopy(norm).double()
    x = torch.randn(2, 8, 3, 9, 10) * torch.linspace(0.5, 2.0, 8).view(1, 8, 1, 1, 1)
    for offset in (0.0, 100.0):
        xo = x + offset
        ref, truth = norm(xo), norm64(xo.double())
        ref_err = (ref.double() - truth).abs().max().item()
        for size in (4, 2):
            sizes = split_sizes(x.shape[dim], size)  # 9 -> 3,2,2,2 / 5,4; 10 -> 3,3,2,2 / 5,5
            for rank, out in enumerate(pool.run(job_group_norm, norm, xo, dim, size)):
                r = rank % size
                what = f"offset {offset}, {size} ranks, rank {rank}"
                if offset == 0.0:
                    expected = ref.narrow(dim, sum(sizes[:r]), sizes[r])
                    torch.testing.assert_close(out, expected, **TOL, msg=lambda m: f"{what}: {m}")
                err = (out.double() - truth.narrow(dim, sum(sizes[:r]), sizes[r])).abs().max().item()
                assert err <= max(2 * ref_err, 1e-6), f"{what}: {err:.3e} from fp64 (unsplit: {ref_err:.3e})"


@torch.no_grad()
def test_group_norm_bf16(pool):
    """bf16 activations and weights: fp32 statistics inside, bf16 out, within bf16 rounding
    (one bf16 ulp is 2**-8 relative) of the unsplit bf16 GroupNorm."""
    torch.manual_seed(1)
    norm = nn.GroupNorm(4, 8, eps=1e-6)
    nn.init.normal_(norm.weight, 1.0, 0.2)
    nn.init.normal_(norm.bias, 0.0, 0.2)
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(2, 8, 3, 9, 10) + 2).to(torch.bfloat16)
    ref = norm(x)
    sizes = split_sizes(x.shape[-2], 4)
    for rank, out in enumerate(pool.run(job_group_norm, norm, x, -2, 4)):
        assert out.dtype == torch.bfloat16
        expected = ref.narrow(-2, sum(sizes[:rank]), sizes[rank])
        torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)


def test_combined_moments_equal_whole():
    """Chan's combination of per-part (count, mean, M2) equals the moments of the whole."""
    torch.manual_seed(0)
    x = 100 + torch.randn(2, 8, 3, 9, 10)
    parts = torch.stack([group_moments(p, 4) for p in x.tensor_split(4, dim=-2)])
    mean, var = combine_moments(parts)
    whole = x.double().reshape(2, 4, -1)
    torch.testing.assert_close(mean, whole.mean(-1), rtol=1e-7, atol=1e-6)
    torch.testing.assert_close(var, whole.var(-1, correction=0), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_weights_not_copied_and_vae_untouched(pool, vae):
    latents = _latents(LATENT["height"], seed=3)
    ref = vae.decode(latents)
    for rank, r in enumerate(pool.run(job_no_copy, latents)):
        assert r["same_params"], "the split decoder must use the VAE's own parameter tensors"
        assert "HaloConv" in r["twin_kinds"] and "DistGroupNorm" in r["twin_kinds"]
        assert "ParallelAttnBlock" in r["twin_kinds"] and "AttnBlock" in r["twin_kinds"]
        assert r["after_call"] == r["before"], "the VAE's modules changed after a parallel decode"
        assert r["error"] is not None and "channels" in r["error"]
        assert r["after_error"] == r["before"], "the VAE's modules changed after a failed parallel decode"
        _check(r["image"], ref, f"decode in the no-copy job, rank {rank}")


def test_bad_split_fails_with_message(pool):
    msgs = pool.run(job_bad_split, _latents((1, 32, 3, 6)), "height", 4)
    assert all(m is not None and "latent height 3 cannot be split over 4 ranks" in m for m in msgs), msgs
    msgs = pool.run(job_bad_split, _latents((1, 32, 4, 1)), "width", 2)
    assert all(m is not None and "latent width 1 cannot be split over 2 ranks" in m for m in msgs), msgs
    msgs = pool.run(job_bad_split, _latents((1, 32, 4, 4)), "depth", 4)
    assert all(m is not None and "dim must be one of" in m for m in msgs), msgs
    msgs = pool.run(job_bad_split, _latents((1, 32, 4, 4)), "height", 2, 5)
    assert all(m is not None and "rank of the group of 2" in m for m in msgs), msgs


def test_unsupported_convs_are_refused():
    check_halo_conv(nn.Conv3d(2, 2, 3, padding=1), -2)
    for conv, what in [(nn.Conv2d(2, 2, 3, padding=1, stride=2), "stride 2"),
                       (nn.Conv2d(2, 2, 3, padding=0), "padding 0"),
                       (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "padding_mode"),
                       (nn.ConvTranspose2d(2, 2, 3, padding=1), "only nn.Conv")]:
        with pytest.raises(ValueError, match=what):
            check_halo_conv(conv, -1)
    with pytest.raises(ValueError, match="extent 3 cannot be split over 4 ranks"):
        split_sizes(3, 4)
    assert split_sizes(10, 4) == [3, 3, 2, 2]


@torch.no_grad()
def test_naive_split_is_far_off(vae):
    """Decoding each latent half on its own (no halos, per-half norms and attention) is far
    outside the tolerance, so the parity tests above can fail."""
    latents = _latents(LATENT["height"])
    naive = torch.cat([vae.decode(half) for half in latents.tensor_split(2, dim=-2)], dim=-2)
    assert (naive - vae.decode(latents)).abs().max() > 1e-2

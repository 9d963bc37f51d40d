"""Pipeline pieces: resolution table, sampling, scheduler, RoPE, mask, the tiny default."""
import json

import pytest
import torch

from dtgen.layers.flow_match import classifier_free_guidance, euler_step, flow_match_sigmas
from dtgen.attention import structured_mask
from dtgen.layers.rope import apply_rope
from models.hunyuan_image3.rope import image_rope_positions, rope_cos_sin
from dtgen.sampling import Sampling, sample_token
from models.hunyuan_image3.resolutions import resolution_table
from models.hunyuan_image3.tiny import ensure_tiny_checkpoint
from placements.hunyuan_image3 import get_plan


def test_resolution_table_matches_the_official_layout():
    table = resolution_table(1024)
    assert len(table) == 37  # 33 on the grid + 4 extras, one per <img_ratio_k>
    assert table[0] == (512, 2048) and table[16] == (1024, 1024) and table[32] == (2048, 512)
    assert table[33:] == [(1024, 768), (1280, 720), (768, 1024), (720, 1280)]
    ratios = [h / w for h, w in table[:33]]
    assert ratios == sorted(ratios)
    assert all(h % 16 == 0 and w % 16 == 0 for h, w in table)


def test_greedy_and_filtered_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert int(sample_token(logits, None, 0.0, 0, 1.0)) == 1
    g = torch.Generator().manual_seed(0)

    def draws(logits, n, top_k, top_p, temperature=1.0):
        return [int(sample_token(logits, torch.rand(logits.shape[0], generator=g), temperature, top_k, top_p))
                for _ in range(n)]
    # top-k 2 keeps ids 1 and 3 only
    assert set(draws(logits, 200, 2, 1.0)) == {1, 3}
    # top-p keeps the smallest set reaching p: here only the top token
    assert set(draws(torch.tensor([0.0, 10.0, 0.0]), 50, 0, 0.5)) == {1}
    # top-p 0.9 over probabilities [0.5, 0.3, 0.15, 0.05]: keeps the first three
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert set(draws(probs.log(), 300, 0, 0.9)) == {0, 1, 2}


def test_gumbel_sampling_follows_the_distribution():
    """The Gumbel-max draw is a draw from softmax(logits / T): frequencies match."""
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    uniform = torch.rand(n, 4, generator=g)
    counts = torch.bincount(torch.stack([sample_token(probs.log() * 2, u, 2.0, 0, 1.0) for u in uniform]),
                            minlength=4)
    # 4000 draws: the standard deviation of each frequency is below 0.008
    torch.testing.assert_close(counts / n, probs, atol=0.03, rtol=0)


def test_flow_match_sigmas_and_euler():
    s = flow_match_sigmas(4, 3.0)
    assert s[0] == 1.0 and s[-1] == 0.0 and torch.all(s[:-1] > s[1:])
    sigma = 0.5
    assert s.dtype == torch.float32   # the official scheduler's dtype (the Taylor golden checks it bit for bit)
    assert torch.isclose(flow_match_sigmas(2, 3.0)[1], torch.tensor(3 * sigma / (1 + 2 * sigma)))
    x, v = torch.ones(2), torch.full((2,), 2.0)
    assert torch.equal(euler_step(x, v, 0.8, 0.6), x + v * (0.6 - 0.8))
    assert torch.equal(classifier_free_guidance(torch.ones(1), torch.zeros(1), 5.0), torch.full((1,), 5.0))


def test_rope_text_is_1d_and_rotate_half_pairs():
    pos = torch.tensor([[3, 3], [7, 7]])
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.allclose(cos[1, :4], torch.cos(7 * inv)) and torch.allclose(cos[1, 4:], cos[1, :4])
    x = torch.zeros(1, 2, 1, 8)
    x[..., 0] = 1.0  # dim 0 pairs with dim 4
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y[0, 1, 0, 0], torch.cos(torch.tensor(7.0))) and torch.allclose(
        y[0, 1, 0, 4], torch.sin(torch.tensor(7.0)))


def test_image_rope_uses_y_on_even_and_x_on_odd_frequencies():
    pos = image_rope_positions(10, 2, 3)  # h=2, w=3
    assert pos[:, 0].tolist() == [12, 12, 12, 13, 13, 13]   # y0 = 10 + (6 - 2) // 2
    assert pos[:, 1].tolist() == [11, 12, 13, 11, 12, 13]   # x0 = 10 + (6 - 3) // 2
    cos, _ = rope_cos_sin(pos, 8, 10000.0)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.allclose(cos[1, 0], torch.cos(12 * inv[0])) and torch.allclose(cos[1, 1], torch.cos(12 * inv[1]))
    assert torch.allclose(cos[3, 0], torch.cos(13 * inv[0])) and torch.allclose(cos[3, 1], torch.cos(11 * inv[1]))


def test_structured_mask():
    slots = torch.arange(6)
    m = structured_mask(slots, slots, ((2, 4),))
    assert m[2, 3] and m[3, 2]          # inside the image block: bidirectional
    assert not m[1, 2] and not m[4, 5]  # causal elsewhere
    assert m[5, 3] and not m[3, 4]      # text after the image sees it; the image does not see it
    # Padding rows (slots past the sequence) are invisible to every real query.
    k = torch.arange(8)
    assert not structured_mask(slots, k, ((2, 4),))[:, 6:].any()


def test_tiny_checkpoint_written_once_and_atomically(tmp_path):
    path = ensure_tiny_checkpoint(tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    mtime = (path / "model.safetensors.index.json").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(tmp_path) == path
    assert (path / "model.safetensors.index.json").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folder left behind


def _tiny_pipe(ckpt):
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from placements.hunyuan_image3 import get_plan
    loaded = load(ckpt, get_plan("single"))
    return HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")


def test_kept_caches_carry_nothing_from_one_request_to_the_next(tiny_checkpoint):
    """The pipeline reuses its KV caches across requests (one CUDA-graph recording): a
    request after a longer one gives exactly what a fresh pipeline gives, and prompts in one
    length bucket share the AR cache."""
    from models.hunyuan_image3.requests import T2IRequest
    common = dict(steps=2, max_new_tokens=3, image_size="256x256", seed=5, ignore_stop=True)
    long_request = T2IRequest(prompt="a long prompt about a lighthouse on a cliff at dusk", **common)
    short_request = T2IRequest(prompt="a fox", **common)
    pipe = _tiny_pipe(tiny_checkpoint)
    pipe.generate(long_request)
    ar_cache = pipe._caches.kept("ar")
    reused = pipe.generate(short_request)
    assert pipe._caches.kept("ar") is ar_cache            # same length bucket: same buffers
    fresh = _tiny_pipe(tiny_checkpoint).generate(short_request)
    assert reused.tokens == fresh.tokens
    for a, b in zip(reused.record["ar_logits"], fresh.record["ar_logits"]):
        assert torch.equal(a, b)
    assert torch.equal(reused.latents, fresh.latents)


def test_the_pipeline_runs_the_requests_own_check_before_any_work(tiny_checkpoint):
    """generate (and so generate_batch) checks every request with `T2IRequest.check`, the
    CLI's and the server's check: a bad field is its `RequestError`, no phase runs."""
    from dtgen.requests import RequestError
    from models.hunyuan_image3.requests import T2IRequest
    pipe = _tiny_pipe(tiny_checkpoint)
    pipe.run_ar_phases = None   # calling it would raise a TypeError, not the request's error
    with pytest.raises(RequestError) as e:
        pipe.generate(T2IRequest(prompt="a fox", cfg_mode="both"))
    assert e.value.field == "cfg_mode" and e.value.message == "must be 'serial' or 'batch', got 'both'"


def test_stop_token_read_one_step_late_changes_nothing(tiny_checkpoint):
    """The decode loop launches step i before the host has read token i (so host work overlaps
    the device); a stop token's step is dropped. The result must equal a run that stops at the
    same place: the same tokens, one logit row per fed token, the same ratio and latents."""
    from models.hunyuan_image3.requests import T2IRequest
    common = dict(prompt="a red fox", steps=2, image_size="256x256", seed=11, temperature=0.9, top_k=0)
    pipe = _tiny_pipe(tiny_checkpoint)
    free = pipe.generate(T2IRequest(max_new_tokens=6, ignore_stop=True, **common))
    assert len(free.tokens) == 6
    stop = free.tokens[3]
    # the first stop or <eos> ends generation
    cut = next(i for i, t in enumerate(free.tokens) if t in (stop, pipe.special.eos))
    stopped = pipe.generate(T2IRequest(max_new_tokens=6, stop_ids=(stop,), **common))
    assert stopped.tokens == free.tokens[:cut]
    # prefill + one row per fed token + the image head's last row
    assert len(stopped.record["ar_logits"]) == 1 + cut + 1
    for a, b in zip(stopped.record["ar_logits"][:1 + cut], free.record["ar_logits"]):
        assert torch.equal(a, b)
    forced = pipe.generate(T2IRequest(max_new_tokens=6, forced_tokens=tuple(free.tokens[:cut]), **common))
    assert forced.tokens == stopped.tokens and forced.ratio_index == stopped.ratio_index
    assert torch.equal(forced.record["ar_logits"][-1], stopped.record["ar_logits"][-1])
    assert torch.equal(forced.latents, stopped.latents)


def test_ranks_leaving_ar_with_different_tokens_fail_instead_of_hanging(tiny_checkpoint, monkeypatch):
    """The denoise sequence (so every collective's shape) is built from the AR tokens: ranks
    compare count, digest and ratio before the switch, and a mismatch raises on every rank."""
    import pytest

    from models.hunyuan_image3.requests import T2IRequest
    pipe = _tiny_pipe(tiny_checkpoint)
    seen = []

    def two_ranks_disagree(what, values):
        seen.append(what)
        return [list(values), [values[0], values[1] + 1, values[2]]]

    monkeypatch.setattr(pipe.controller, "agree", two_ranks_disagree)
    with pytest.raises(RuntimeError, match="ranks left the AR phase with different tokens"):
        pipe.generate(T2IRequest(steps=1, max_new_tokens=2, image_size="256x256"))
    assert seen == ["AR tokens"]


def test_sampling_settings_are_tensors_for_the_compiled_step():
    """A compiled step takes temperature, top-k and top-p as tensors: new values reuse its
    graph (only the sort width, top-k rounded up to a power of two, is static), and draw
    exactly what the numbers draw."""
    from dtgen.compile import unique_graphs

    vocab = 300
    assert Sampling(0.6, 0, 0.9).candidates(vocab) == vocab
    assert Sampling(0.6, 100, 0.9).candidates(vocab) == 128 == Sampling(0.6, 65, 0.9).candidates(vocab)
    assert Sampling(0.6, 200, 0.9).candidates(vocab) == 256
    assert Sampling(0.6, 290, 0.9).candidates(vocab) == vocab            # 512 is capped at the vocabulary
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(vocab, generator=g) * 3
    step = torch.compile(sample_token, fullgraph=True, backend="eager")
    settings = [Sampling(0.6, 100, 0.95), Sampling(1.3, 70, 0.5), Sampling(0.9, 128, 1.0), Sampling(0.0, 90, 0.9)]
    before = None
    for s in settings:
        args = s.step_args(vocab, torch.device("cpu"))
        for _ in range(5):
            u = torch.rand(vocab, generator=g)
            expected = sample_token(logits, u, s.temperature, s.top_k, s.top_p)
            assert int(step(logits, u, args.temperature, args.top_k, args.top_p, args.candidates)) == int(expected)
        before = unique_graphs() if before is None else before
    assert unique_graphs() == before, "a new sampling setting in the same top-k bucket compiled a new graph"


def test_released_caches_change_no_output_and_leave_no_cache(tiny_checkpoint, monkeypatch):
    """kv_caches="release" (--kv-caches release, a memory lever): the AR cache is gone when
    denoise starts, the denoise caches when the VAE decodes, nothing is kept after the request,
    and the outputs are the kept-cache pipeline's, bit for bit. About 2 s."""
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.requests import T2IRequest
    req = T2IRequest(prompt="a fox", steps=2, max_new_tokens=3, image_size="256x256", seed=5, ignore_stop=True)
    loaded = load(tiny_checkpoint, get_plan("single"))
    keep = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu").generate(req)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", kv_caches="release")
    seen = {}
    run_denoise, decode_image = pipe.run_denoise_batch, pipe.decode_image

    def denoise(*a, **k):
        seen["denoise"] = sorted(pipe._caches._kept)
        return run_denoise(*a, **k)

    def decode(*a, **k):
        seen["vae"] = sorted(pipe._caches._kept)
        return decode_image(*a, **k)
    monkeypatch.setattr(pipe, "run_denoise_batch", denoise)
    monkeypatch.setattr(pipe, "decode_image", decode)
    released = pipe.generate(req)
    assert seen == {"denoise": [], "vae": []} and pipe._caches.nbytes == 0
    assert released.tokens == keep.tokens and torch.equal(released.latents, keep.latents)
    assert torch.equal(released.image, keep.image)
    with pytest.raises(ValueError, match="kv_caches must be one of"):
        HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", kv_caches="drop")


def test_keep_ar_releases_the_denoise_caches_and_keeps_the_ar_cache_across_requests(tiny_checkpoint, monkeypatch):
    """kv_caches="keep-ar" (--kv-caches keep-ar): the denoise caches are gone when the VAE
    decodes, the AR cache stays, and the next request of the same shape decodes into the same
    buffers (so a CUDA-graph decode step records once); outputs are the kept-cache pipeline's."""
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.requests import T2IRequest
    req = T2IRequest(prompt="a fox", steps=2, max_new_tokens=3, image_size="256x256", seed=5, ignore_stop=True)
    loaded = load(tiny_checkpoint, get_plan("single"))
    keep = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu").generate(req)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", kv_caches="keep-ar")
    seen = {}
    decode_image = pipe.decode_image

    def decode(*a, **k):
        seen["vae"] = sorted(pipe._caches._kept)
        return decode_image(*a, **k)
    monkeypatch.setattr(pipe, "decode_image", decode)
    first = pipe.generate(req)
    assert seen == {"vae": ["ar"]}
    ar_k = pipe._caches.kept("ar").layers[0].k.data_ptr()
    second = pipe.generate(req)
    assert pipe._caches.kept("ar").layers[0].k.data_ptr() == ar_k
    for out in (first, second):
        assert out.tokens == keep.tokens and torch.equal(out.latents, keep.latents)


def test_vae_layout_channels_last_gives_the_ncdhw_image_and_a_later_pipeline_resets_it(tiny_checkpoint):
    """vae_layout="channels-last" (--vae-layout) on the tiny checkpoint's fp32 VAE: the same image
    as the NCDHW path to float32 summation order; a pipeline built later with "ncdhw" (or "auto"
    on the CPU) puts the shared VAE back on NCDHW."""
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.requests import T2IRequest
    req = T2IRequest(prompt="a fox", steps=2, max_new_tokens=2, image_size="256x256", seed=5, ignore_stop=True)
    loaded = load(tiny_checkpoint, get_plan("single"))
    plain = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu").generate(req)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", vae_layout="channels-last")
    assert loaded.model.vae.channels_last == {"decoder": True, "encoder": False}   # no encoder in a T2I checkpoint
    out = pipe.generate(req)
    assert out.tokens == plain.tokens and torch.equal(out.latents, plain.latents)
    torch.testing.assert_close(out.image, plain.image, rtol=1e-4, atol=1e-4)   # [0, 1] floats
    HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", vae_layout="ncdhw")
    assert loaded.model.vae.channels_last == {"decoder": False, "encoder": False}


def test_vae_dtype_overrides_the_checkpoint(tiny_checkpoint):
    """--vae-dtype bfloat16: the VAE's weights (and so its compute) in bf16, the rest as asked."""
    from models.hunyuan_image3.loading import load
    loaded = load(tiny_checkpoint, get_plan("single"), vae_dtype="bfloat16")
    assert {p.dtype for p in loaded.model.vae.parameters()} == {torch.bfloat16}
    assert loaded.model.lm_head.weight.dtype == torch.float32


@torch.no_grad()
def test_moe_token_chunks_change_no_output(tiny_checkpoint):
    """--moe-token-chunk N (a memory lever): the routed experts over N tokens a call give every
    token the output it gets with all tokens at once (each token's sum is its own; float32 on
    the CPU: to rounding), for a chunk that does not divide the rows and one that holds them all."""
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.model import set_moe_token_chunk
    model = load(tiny_checkpoint, get_plan("single")).model
    moe = model.model.layers[0].mlp
    x = torch.randn(1, 37, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    whole = moe(x)
    for chunk in (8, 37):
        set_moe_token_chunk(model, chunk)
        torch.testing.assert_close(moe(x), whole, rtol=1e-6, atol=1e-6)
    set_moe_token_chunk(model, None)
    with pytest.raises(ValueError, match="MoE token chunk must be at least 1 row, got 0"):
        set_moe_token_chunk(model, 0)

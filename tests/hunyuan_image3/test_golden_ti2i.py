"""Image editing (TI2I) against the official implementation: every tensor of every TI2I golden
case, in one process. (tests/hunyuan_image3/test_distributed.py replays them on 4 CPU ranks through the
hybrid plans; tests/hunyuan_image3/test_ti2i_vae.py and tests/hunyuan_image3/test_ti2i_vision.py check the encoders'
pieces and their bad inputs.)"""
import pytest
import torch

from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from placements.hunyuan_image3 import get_plan
from tests.support.golden import TI2I_INPUTS, GoldenCase, compare_ti2i_case, discover_ti2i_cases

CASES = discover_ti2i_cases()


@pytest.fixture(scope="module", params=[pytest.param(c, id=c.name) for c in CASES] or
                [pytest.param(None, id="no-golden", marks=pytest.mark.skip(reason="no TI2I golden case folders"))])
def case_results(request):
    case = GoldenCase(request.param)
    loaded = load(case.folder, get_plan("single"), dtype=torch.float32, image_editing=True)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    return case, {c.name: c for c in compare_ti2i_case(case, pipe)}, pipe


def test_every_output_matches(case_results):
    case, results, _ = case_results
    bad = {n: f"max abs {r.max_abs:.3e} {r.detail}" for n, r in results.items() if not r.ok}
    assert not bad, f"{case.folder.name} (rtol {case.rtol}, atol {case.atol}): {bad}"


def test_every_golden_tensor_is_checked(case_results):
    """Nothing in golden.safetensors goes uncompared (inputs excepted): a new tensor in a case
    fails here until the comparison covers it."""
    case, results, _ = case_results
    unchecked = set(case.t) - TI2I_INPUTS - set(results)
    assert not unchecked, f"golden tensors never compared: {sorted(unchecked)}"


def test_the_comparison_can_fail(case_results):
    """The harness flags a wrong result: the velocity off by 0.1% fails the case's tolerance."""
    case, _, _ = case_results
    golden = case.t["diff_pred_step1"]
    assert case.check("x", golden, golden).ok and not case.check("x", golden * (1 + 1e-3), golden).ok


def test_a_whole_edit_request(case_results):
    """`generate` with a reference image: the condition encoded from the image (the seed draws
    the condition latent), the AR "think" decode gives the official greedy tokens, and the
    image keeps the reference's bucket."""
    case, _, pipe = case_results
    inputs = case.meta["conditioning"]["inputs"]
    result = pipe.generate(T2IRequest(prompt=inputs["prompt"], system_prompt=inputs["system_prompt"],
                                      reference=case.t["ref_image_uint8"], seed=int(case.meta["seeds"]["cond_vae_sample"]),
                                      steps=1, max_new_tokens=case.t["ar_generated_ids"].shape[1], temperature=0.0,
                                      ignore_stop=True))
    assert result.tokens == case.t["ar_generated_ids"][0].tolist()
    height, width = result.image_size
    assert result.image.shape == (height, width, 3) and (height, width) == tuple(case.t["cond_vae_resized_uint8"].shape[:2])
    assert result.timings_ms["condition_encode"] > 0


def test_an_edit_through_the_taylor_cache(case_results):
    """TI2I's denoise loop through the official Taylor cache (the condition rows in the cached
    sequence): every step in full (interval 1) is the uncached run bit for bit, and a cached
    step is the head on the extrapolation of the full steps' stack outputs (order 0 after one
    update: the last full step's output, at the cached step's timestep)."""
    from dtgen.step_cache import TaylorConfig
    from tests.support.golden import ti2i_condition
    from models.hunyuan_image3.instruct import encode_with_specials, instruct_prefix
    from models.hunyuan_image3.diffusion_sequence import build_instruct_diffusion_sequence
    from models.hunyuan_image3.requests import RequestRun
    case, _, pipe = case_results
    inputs = case.meta["conditioning"]["inputs"]
    shape, cond = ti2i_condition(case, pipe)
    prefix = instruct_prefix(pipe.tok.encode, pipe.special, pipe.tok.instruct, pipe.cfg.image_base_size, shape,
                             pipe.tok.encode(inputs["prompt"]), inputs["system_prompt"])
    cot = encode_with_specials(pipe.tok.encode, inputs["cot_text"], pipe.tok.instruct)
    seq = build_instruct_diffusion_sequence(prefix, cot, pipe.tok.encode, pipe.special, pipe.tok.instruct,
                                            pipe.cfg.image_base_size, shape.ratio, shape.vae_h, shape.vae_w)
    hidden = []
    full_step = pipe._denoise_fn

    def recording(*args, **kwargs):
        h, v = full_step(*args, **kwargs)
        hidden.append(h)
        return h, v

    def denoise(cache):
        run = RequestRun.fresh(pipe.device)
        pipe.run_denoise(T2IRequest(steps=4, seed=3, step_cache=cache), seq, run, cond)
        return run.record
    plain = denoise(None)
    assert all(torch.equal(a, b) for a, b in zip(plain["velocity"], denoise(TaylorConfig(interval=1))["velocity"]))
    pipe._denoise_fn = recording
    try:
        cached = denoise(TaylorConfig(interval=3))     # full at 0 and 3; 1 and 2 cached (order 0)
    finally:
        pipe._denoise_fn = full_step
    assert cached["step_cache"][0]["full_steps"] == [0, 3]
    t1 = torch.full((1,), cached["step_inputs"][1]["t"])
    for branch in (0, 1):     # serial CFG: one call site per branch, in this order
        expected = pipe.head_velocity(hidden[branch], t1, seq.step_rows, seq.height, seq.width)
        assert torch.equal(cached["velocity"][1][branch:branch + 1], expected)
    assert not torch.equal(cached["velocity"][1], plain["velocity"][1])

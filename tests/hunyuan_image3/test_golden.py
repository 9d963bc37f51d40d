"""Parity with the official implementation: every golden case, single process.

(The 4-rank plans replay the same cases in tests/hunyuan_image3/test_distributed.py.)
"""
import pytest
import torch

from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from placements.hunyuan_image3 import get_plan
from tests.support.golden import GoldenCase, compare_case, discover_cases

CASES = discover_cases()


def _params():
    if not CASES:
        return [pytest.param(None, id="no-golden", marks=pytest.mark.skip(reason="no golden case folders found"))]
    # The routed experts run through the kernel op ("auto": its torch reference on CPU) and
    # through the model's plain loop ("eager"); both must match the official outputs.
    return [pytest.param((c, impl), id=f"{c.name}-moe_{impl}") for c in CASES for impl in ("auto", "eager")]


@pytest.fixture(scope="module", params=_params())
def case_results(request):
    folder, moe_impl = request.param
    case = GoldenCase(folder)
    if moe_impl == "eager":
        # The VAE runs no MoE: its outputs are checked once, under "auto" (the slow part on CPU).
        case.t = {k: v for k, v in case.t.items() if not k.startswith("vae_")}
    loaded = load(case.folder, get_plan("single"), dtype=torch.float32, moe_impl=moe_impl)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    return case, {c.name: c for c in compare_case(case, pipe)}


EXPECTED = ["ar_prefill_logits", "ar_prefill_last_hidden_state", "ar_generated_ids", "ar_decode_logits",
            "diff_input_ids", "diff_rope_pos_yx", "diff_rope_cos", "diff_attention_mask",
            "diff_step1_input_embeds", "diff_step1_layer0_output", "diff_step1_final_hidden_image",
            "diff_image_mask", "diff_timestep_index", "diff_position_ids", "diff_step2_position_ids",
            "diff_step2_attention_mask", "ar_decode_position_ids", "ar_next_id_after_decode",
            "diff_pred_step1", "diff_pred_step2_cached", "diff_pred_step2_full", "vae_decoded",
            "vae_decoder_all_frames", "vae_decoded_nonsquare"]


@pytest.mark.parametrize("output", EXPECTED)
def test_golden_output(case_results, output, request):
    case, results = case_results
    if output not in results:
        if output.startswith("vae_") and "moe_eager" in request.node.name:
            pytest.skip("the VAE runs no MoE: checked under moe_auto")
        pytest.skip(f"case {case.folder.name} has no {output}")
    r = results[output]
    assert r.ok, f"{case.folder.name}/{output}: max abs {r.max_abs:.3e} beyond rtol {case.rtol} atol {case.atol} {r.detail}"


def test_every_golden_tensor_is_checked(case_results):
    """Nothing in golden.safetensors goes uncompared (inputs excepted)."""
    case, results = case_results
    inputs = {"ar_input_ids", "diff_latents_step1", "diff_timesteps_step1", "diff_latents_step2",
              "diff_timesteps_step2", "vae_latent_in", "vae_latent_in_nonsquare"}
    unchecked = set(case.t) - inputs - set(results)
    assert not unchecked, f"golden tensors never compared: {sorted(unchecked)}"


def test_golden_comparison_can_fail(case_results):
    """The harness flags a wrong result: perturb one output and compare again."""
    case, _ = case_results
    golden = case.t["ar_prefill_logits"]
    assert case.check("x", golden, golden).ok
    assert not case.check("x", golden + 1e-3, golden).ok

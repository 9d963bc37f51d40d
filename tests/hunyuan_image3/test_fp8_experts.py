"""FP8 routed experts in the model: `load(..., moe_dtype="fp8")` / `--moe-dtype fp8`.

CPU: the experts are quantized at load and run through the torch emulation of the FP8
path (the kernels themselves are tested in tests/framework/test_moe_grouped_gemm.py). Accuracy is
stated against the official outputs on the tiny golden case. Bounds come from measurement
(float32 model, the tiny checkpoint):

| output | channels | blocks | tensor | bound |
|---|---|---|---|---|
| AR prefill logits, relative L2 | 0.015 | 0.016 | 0.015 | 0.05 |
| AR decode logits | 0.021 | 0.018 | 0.017 | 0.06 |
| velocity, step 1 / step 2 | 0.016 / 0.019 | 0.016 / 0.020 | 0.016 / 0.017 | 0.05 |
| generated tokens, agreement | 1.0 | 1.0 | 1.0 | 1.0 (greedy, few tokens) |

Up to 16 tokens (the golden prompt, decode) the experts are weight-only FP8 (two e4m3
roundings per expert, the weights'); above, x and the activation are rounded too (the
denoise rows: three). Each rounding is ~2.6% rms relative; the routed experts are part of
each layer's update beside the residual and the shared MLP, so the outputs move by
1.5-2%. The bounds leave 2.5-3x. The tiny checkpoint's experts are Gaussian, with no
outlier rows, so one scale per matrix ("tensor") loses nothing here against one per row;
on trained weights with outlier rows it rounds the other rows more coarsely.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtgen.checkpoint import CheckpointError
from dtgen.plan import PlanError
from dtgen.storage import StorageShard, planned_nbytes
from models.hunyuan_image3.cli import main
from kernels.fp8_quant import FP8_DTYPE
from models.hunyuan_image3 import loading
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from placements.hunyuan_image3 import get_plan
from tests.support.golden import GoldenCase, compare_case, discover_cases

CASES = discover_cases()
BOUNDS = {"ar_prefill_logits": 0.05, "ar_decode_logits": 0.06, "diff_pred_step1": 0.05,
          "diff_pred_step2_cached": 0.05, "diff_pred_step2_full": 0.05}


@pytest.fixture(scope="module", params=["channels", "blocks", "tensor"])
def fp8_golden(request):
    if not CASES:
        pytest.skip("no golden case folders found")
    case = GoldenCase(CASES[0])
    loaded = loading.load(case.folder, get_plan("single"), dtype=torch.float32, moe_dtype="fp8",
                          fp8_scales=request.param)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    return request.param, loaded, {c.name: c for c in compare_case(case, pipe)}


def test_fp8_experts_stay_near_the_official_outputs(fp8_golden):
    recipe, _, results = fp8_golden
    for name, bound in BOUNDS.items():
        if name in results:
            assert results[name].rel_l2 < bound, f"{recipe}: {name} relative L2 {results[name].rel_l2:.4f} >= {bound}"
    assert results["ar_generated_ids"].agreement == 1.0
    # Nothing outside the routed experts is quantized: the VAE matches as before.
    assert results["vae_decoded"].ok


def test_fp8_storage_holds_e4m3_experts_and_their_scales(fp8_golden):
    recipe, loaded, _ = fp8_golden
    storage, cfg = loaded.storage, loaded.model.cfg
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size[0]
    prefix = "model.layers.0.mlp.experts."
    assert storage.tensors[prefix + "gate_and_up_proj"].dtype == FP8_DTYPE
    assert storage.tensors[prefix + "down_proj"].dtype == FP8_DTYPE
    gate_up_scale, down_scale = storage.tensors[prefix + "gate_and_up_scale"], storage.tensors[prefix + "down_scale"]
    if recipe in ("channels", "tensor"):
        assert gate_up_scale.shape == (1, E, 2 * I) and down_scale.shape == (E, H)
        if recipe == "tensor":  # one scale per expert matrix, held in every row
            assert (gate_up_scale == gate_up_scale[..., :1]).all() and (down_scale == down_scale[:, :1]).all()
    else:
        blocks = lambda n: -(-n // 128)  # noqa: E731
        assert gate_up_scale.shape == (1, E, blocks(2 * I), blocks(H))
        assert down_scale.shape == (1, E, blocks(H), blocks(I))
    # What the storage holds is what was planned before any byte was read.
    assert storage.nbytes == planned_nbytes(storage.specs, StorageShard(1, 0, 1), torch.float32)
    # The module computes with views of the resident tensors, scales included.
    experts = loaded.model.get_submodule("model.layers.0.mlp.experts")
    assert experts.down_scale.data_ptr() == down_scale.data_ptr()


@pytest.mark.parametrize("dense, bounds", [("model", (0.03, 0.06)), ("fp8", (0.08, 0.07))], ids=["experts", "dense"])
def test_fp8_on_two_ranks_switches_phases_for_free_and_matches_one_rank(tiny_checkpoint, monkeypatch, tmp_path,
                                                                        dense, bounds):
    """tp2 splits the down projections' columns: their per-row scales are the max over both
    ranks (one all-reduce per weight at load), so both ranks quantize the weights exactly as
    one process does. The activations are quantized per rank (over its slice of the
    intermediate dim), which is the measured difference: 0.7% (logits), 2.1% (velocity)
    on 4 ranks (hybrid); on tp2, experts alone: 0.47% / 2.2%.
    One spawned job serves the FP8 dense linears too (`--dense-dtype fp8`, tests/hunyuan_image3/test_fp8_dense.py):
    QKV and the shared gate/up split by rows with their scales, O and the shared down by
    columns with replicated scales (the max over both ranks); their activations are also
    quantized per rank, and the tiny model amplifies it (see test_fp8_dense.py): both options,
    5.0% (logits) / 4.6% (velocity) on tp2. Bounds: experts alone 0.03 / 0.06,
    with dense FP8 0.08 / 0.07 (two jobs, so the experts' tighter check stays)."""
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))
    report = tmp_path / "r.json"
    assert main(["--world-size", "2", "--plan", "tp2", "--moe-dtype", "fp8", "--dense-dtype", dense, "--steps", "2",
                 "--max-new-tokens", "2", "--image-size", "256x256", "--check", "--output", str(tmp_path / "i.png"),
                 "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["moe_dtype"] == "fp8-channels" and r["dense_dtype"] == dense
    switch, check = r["phase_switch"], r["check"]
    assert switch["weights_copied"] == 0 and switch["allocated_bytes_delta"] == 0
    assert switch["param_bytes_before"] == switch["param_bytes_after"]
    assert check["rel_l2_logits"] < bounds[0] and check["rel_l2_velocity"] < bounds[1], check


def test_block_scales_refuse_a_split_that_cuts_a_block(tiny_checkpoint):
    """The tiny model's intermediate size is not a multiple of 2 x 128: tp2 would cut blocks."""
    with pytest.raises(PlanError, match=r"gate_and_up_proj: FP8 block scales are 128x128 blocks .* cuts"):
        loading.load(tiny_checkpoint, get_plan("tp2"), rank=0, world_size=2, dtype=torch.float32,
                     moe_dtype="fp8", fp8_scales="blocks")


def test_fp8_checkpoint_and_bad_options_are_refused_by_name(tiny_checkpoint, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    key = "model.layers.0.mlp.experts.0.down_proj.weight"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    path = ckpt / index["weight_map"][key]
    tensors = load_file(str(path))
    tensors[key] = tensors[key].to(FP8_DTYPE)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight is "
                                              r"stored in F8_E4M3: FP8 checkpoints are not loaded as they are"):
        loading.load(ckpt, get_plan("single"), moe_dtype="fp8")
    with pytest.raises(ValueError, match="moe_dtype must be one of"):
        loading.load(tiny_checkpoint, get_plan("single"), moe_dtype="int4")
    with pytest.raises(ValueError, match="fp8_scales must be one of"):
        loading.load(tiny_checkpoint, get_plan("single"), moe_dtype="fp8", fp8_scales="rows")
    monkeypatch.setattr(loading, "fp8_support_problem", lambda device: "no FP8 tensor cores on this test device")
    with pytest.raises(RuntimeError, match="--moe-dtype fp8: no FP8 tensor cores on this test device"):
        loading.load(tiny_checkpoint, get_plan("single"), moe_dtype="fp8")


def _two_rank_expert_storage(recipe: str):
    """Rank 0 of storage TP2: a column-split (ROW) down weight and a row-split (PAIR) gate/up,
    two experts each, random, quantized with `recipe`. reduce_max stands in for the
    all-reduce ("the other rank's maxima were twice ours") and records what it was given."""
    from dtgen.plan import Rule
    from dtgen.storage import ParamSpec, ResidentStorage, scale_spec

    down = ParamSpec(keys=("e0", "e1"), rule=Rule.ROW, official_shape=(8, 64), stacked=True, micro_packed=True,
                     dtype=FP8_DTYPE, fp8=recipe)
    gate_up = ParamSpec(keys=("e0", "e1"), rule=Rule.PAIR, official_shape=(16, 8), stacked=True, micro_packed=True,
                        dtype=FP8_DTYPE, fp8=recipe)
    specs = {"down": down, "down_scale": scale_spec(down), "gate_up": gate_up, "gate_up_scale": scale_spec(gate_up)}
    seen = []

    def reduce_max(amax):
        seen.append(amax.clone())
        return amax * 2

    return ResidentStorage.random(specs, StorageShard(2, 0, 1), torch.float32, reduce_max=reduce_max), seen


def test_column_split_weights_take_their_row_scales_over_all_ranks():
    """Storage plumbing: a column-split (ROW) FP8 weight hands its local row maxima to
    `reduce_max` and is quantized with what comes back; a row-split one needs no exchange."""
    storage, seen = _two_rank_expert_storage("channels")
    assert len(seen) == 1 and seen[0].shape == (2, 8)          # down only: [E, H] row maxima
    torch.testing.assert_close(storage.tensors["down_scale"], seen[0] * 2 / 448)
    assert storage.tensors["down"].shape == (1, 2, 8, 32)       # this rank's half of the columns
    assert storage.tensors["gate_up_scale"].shape == (1, 2, 8)  # its half of the rows, one scale each
    # Values sit at half the e4m3 range: the scale is the global one, not this rank's.
    assert storage.tensors["down"].float().abs().amax() <= 224


def test_tensor_scales_are_one_per_official_matrix_over_all_ranks():
    """Recipe "tensor": every weight, split by rows or by columns, hands its local per-expert
    maxima to `reduce_max`, and its scales (the channels layout) hold the global one."""
    storage, seen = _two_rank_expert_storage("tensor")
    assert [t.shape for t in seen] == [(2,), (2,)]              # one max per expert, each weight
    down_scale, gate_up_scale = storage.tensors["down_scale"], storage.tensors["gate_up_scale"]
    assert down_scale.shape == (2, 8) and gate_up_scale.shape == (1, 2, 8)
    torch.testing.assert_close(down_scale, (seen[0] * 2 / 448)[:, None].expand(2, 8))
    torch.testing.assert_close(gate_up_scale, (seen[1] * 2 / 448)[None, :, None].expand(1, 2, 8))
    assert storage.tensors["gate_up"].float().abs().amax() <= 224


def _assert_fp8_golden_on_gpu(recipe: str, moe_impl: str = "auto") -> None:
    """The first golden case through FP8 experts on the GPU, within BOUNDS; the same AR tokens."""
    case = GoldenCase(CASES[0])
    loaded = loading.load(case.folder, get_plan("single"), dtype=torch.float32, device="cuda", moe_dtype="fp8",
                          fp8_scales=recipe, moe_impl=moe_impl)
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, torch.device("cuda"))
    results = {c.name: c for c in compare_case(case, pipe)}
    for name, bound in BOUNDS.items():
        if name in results:
            assert results[name].rel_l2 < bound, f"{recipe}: {name} relative L2 {results[name].rel_l2:.4f} >= {bound}"
    assert results["ar_generated_ids"].agreement == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["channels", "blocks", "tensor"])
def test_gpu_fp8_experts_stay_near_the_official_outputs(recipe):
    """The same golden bounds with the FP8 kernels on a GPU (float32 model: the experts'
    x and activation are still rounded to e4m3, the weights stay e4m3)."""
    if not CASES:
        pytest.skip("no golden case folders found")
    _assert_fp8_golden_on_gpu(recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("moe_impl", ["scaled_grouped_mm", "gluon"])
@pytest.mark.parametrize("recipe", ["channels", "tensor"])
def test_gpu_fp8_experts_through_scaled_grouped_mm_stay_near_the_official_outputs(recipe, moe_impl):
    """The same golden bounds with the denoise rows' expert GEMMs in torch._scaled_grouped_mm
    (`--moe-impl scaled_grouped_mm`, sm90) or in our Gluon kernel on the same pipeline (`--moe-impl
    gluon`, sm90): x and the activation rounded to e4m3 as on the Triton path, the activation per
    (micro, slot) row, u and the partials to bf16."""
    if not CASES:
        pytest.skip("no golden case folders found")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"MoE impl {moe_impl!r} runs an sm90 rowwise FP8 kernel")
    _assert_fp8_golden_on_gpu(recipe, moe_impl=moe_impl)

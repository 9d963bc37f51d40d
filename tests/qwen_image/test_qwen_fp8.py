"""Qwen-Image's FP8 options (`--dense-dtype fp8`, `--attention-dtype fp8`: dtgen/fp8.py, as
Wan's) on a tiny random folder with head_dim 64 (the FP8 attention kernel takes 64 and 128).
CPU, float32: the FP8 kernels' torch references. Each option against the model-dtype run (which
equals diffusers': tests/qwen_image/test_qwen_image.py); the dense option on TP2 against one
process (its row-split linears carry a bias: the controller adds it once after the sum)."""
import pytest
import torch
import torch.distributed as dist

from dtgen.fp8 import fp8_linear_names
from dtgen.launch import RankPool
from models.qwen_image.model import FP8_LINEARS, load
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest
from models.qwen_image.tiny import ensure_tiny_checkpoint, write_random_checkpoint
from placements.qwen_image import get_plan

REQUEST = T2IRequest(prompt="a red fox runs on the snow at night", negative_prompt="blurry", height=48, width=64,
                     steps=3, true_cfg_scale=4.0, seed=5)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-hd64")
    write_random_checkpoint(root, overrides={"transformer": {"attention_head_dim": 64, "num_attention_heads": 2,
                                                             "axes_dims_rope": [16, 24, 24]}})
    return root


def _pipe(folder, plan="single", rank=0, world=1, **dtypes):
    loaded = load(folder, get_plan(plan), rank, world, **dtypes)
    return QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0,
                             vae_group=dist.group.WORLD if world > 1 else None)


def _latents(pipe):
    return pipe.generate(REQUEST, decode=False).latents


def test_fp8_options_stay_near_the_model_dtype_run(folder):
    """3 steps with true CFG, final latents against the float32 run (which are mostly the noise,
    as Wan's test says). Measured: dense 0.30%, attention 0.043%, both 0.33%
    relative L2. Bounds 1% / 0.2% / 1% (Wan's)."""
    base = _latents(_pipe(folder))
    bounds = {("fp8", "model"): 0.01, ("model", "fp8"): 2e-3, ("fp8", "fp8"): 0.01}
    for (dense, attention), bound in bounds.items():
        pipe = _pipe(folder, dense_dtype=dense, attention_dtype=attention)
        swapped = fp8_linear_names(pipe.model)
        blocks = pipe.model.cfgs.transformer.num_layers
        # per block: 6 projections + 2 outputs (attn), 2 x 2 MLP linears, 2 modulations
        assert len(swapped) == (14 * blocks if dense == "fp8" else 0), swapped
        assert all(n.startswith("transformer.transformer_blocks.") for n in swapped)
        err = rel(_latents(pipe), base)
        assert 0 < err < bound, f"dense {dense}, attention {attention}: relative L2 {err:.2e} (bound {bound})"


def job_dense_fp8(ctx, folder):
    return _latents(_pipe(folder, "tp2", ctx.rank, ctx.world_size, dense_dtype="fp8"))


def test_dense_fp8_on_tp2_stays_as_near_as_one_process(folder):
    """TP2 splits the FP8 linears (row-split ones keep their weight scales whole and their bias
    for after the all-reduce). Not bit-equal to one process: a row-split linear quantizes each
    rank's half of x with that half's own per-token scale. Measured: 0.32% from
    one process's FP8 latents, 0.30% from the float32 run (one process's FP8: 0.30%); both
    ranks equal. (Whether the bias lands once is tests/framework/test_partial_sum_bias.py's
    and the bf16 plans test's: the latents here hardly see it.)"""
    base = _latents(_pipe(folder))
    want = _latents(_pipe(folder, dense_dtype="fp8"))
    with RankPool(2, timeout_s=240) as pool:
        got = pool.run(job_dense_fp8, folder)
    torch.testing.assert_close(got[0], got[1], atol=0, rtol=0)
    assert rel(got[0], want) < 0.01 and rel(got[0], base) < 0.01, (rel(got[0], want), rel(got[0], base))


def test_fp8_refusals_name_the_problem(tmp_path):
    tiny = ensure_tiny_checkpoint(tmp_path)   # head_dim 16: FP8 attention runs it padded to 64
    wide = tmp_path / "qwen-hd192"
    write_random_checkpoint(wide, overrides={"transformer": {"attention_head_dim": 192, "num_attention_heads": 1,
                                                             "axes_dims_rope": [64, 64, 64]}})
    with pytest.raises(ValueError, match=r"--attention-dtype fp8: the FP8 attention kernel handles head_dim "
                                         r"up to 128; this model has 192"):
        load(wide, get_plan("single"), attention_dtype="fp8")
    with pytest.raises(ValueError, match="dense_dtype must be one of"):
        load(tiny, get_plan("single"), dense_dtype="fp4")
    assert all(p.startswith("transformer.transformer_blocks.") for p in FP8_LINEARS)


@pytest.mark.gpu
def test_gpu_qwen_compiled_fp8_options_match_eager(folder):
    """The tiny head_dim-64 Qwen-Image in bf16 on one GPU with both FP8 options, each block
    compiled as a region (the FP8 GEMV / scaled_mm linears and the FP8 attention op trace as one
    node each): the latents match the eager FP8 run's (bf16 fusions round differently: bound 2e-2
    relative L2), which stays near the bf16 SDPA run (bound 2e-2). Bounds are Wan's
    (tests/wan/test_fp8_attention.py)."""
    from dtgen.compile import CompileOptions
    out = {}
    for name, fp8, compiled in (("bf16", "model", False), ("eager", "fp8", False), ("compiled", "fp8", True)):
        loaded = load(folder, get_plan("single"), dtype=torch.bfloat16, device="cuda", dense_dtype=fp8,
                      attention_dtype=fp8)
        pipe = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                                 compile_options=CompileOptions(enabled=compiled, regions=compiled))
        out[name] = pipe.generate(REQUEST, decode=False).latents.float().cpu()
    assert rel(out["compiled"], out["eager"]) < 2e-2
    assert rel(out["eager"], out["bf16"]) < 2e-2

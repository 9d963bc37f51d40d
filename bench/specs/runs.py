"""Every JSON the page reads (its path under bench/results/) and the command that reproduces it: `RUNS`.

A command is `python -m bench SUITE PART ARGS` (bench/suites.py; `dtgen bench` is the same) with the
flags that ran, or for two GPUs `python -m bench run-all SUITE:STEP`, the GPU runner's step that starts
the ranks under torchrun with them.
"""
from __future__ import annotations

from bench.report_cells import RunInfo

GPU_IMAGE = "torch 2.11.0+cu130, triton 3.6.0"
WITH_DIFFUSERS = f"{GPU_IMAGE}, diffusers 0.42.1"
CPU_STACK = "torch 2.13.0+cpu, triton 3.9.0"

# ---- HunyuanImage-3.0, one H200 ---------------------------------------------------------------------------
DECODE = "h200-2026-12-03-keep-ar/fusions-reverted/decode_dense_fp8.json"
T2I = "h200-2026-12-03-fp8-attention/hy-attention-fp8/t2i_attn_fp8.json"
TI2I = "h200-2026-12-03-fp8-attention/hy-attention-fp8/ti2i_attn_fp8.json"
T2I_CFG_BATCH = "h200-2026-12-03-side-stream-cfg/cfg-batch/t2i_cfg_batch.json"
TI2I_CFG_BATCH = "h200-2026-12-03-side-stream-cfg/cfg-batch/ti2i_cfg_batch.json"
MEMORY = "h200-2026-12-03-keep-ar/fusions-reverted/bench_memory.json"
STEP_CACHE = "h200-2026-12-01-step-cache/step_cache_t2i_ti2i.json"
DISTIL = "h200-2026-12-01-step-cache/step_cache_distil.json"
VAE_SUITE = "h200-2026-12-03-keep-ar/fusions/bench_vae_suite.json"
VAE_FLOPS = "cpu-2026-12-02-vae/vae_flops.json"
SERVE = "h200-2026-12-03/serve-peers/bench_serve.json"
ATTENTION = "h200-2026-12-03-fp8-attention/default-tiles/bench_fp8_attention_sweep.json"
ATTENTION_14B = "h200-2026-12-03-side-stream-cfg/long-key-tiles/bench_fp8_attention_14b.json"
SPLIT_KV = "h200-2026-12-02/decode_kernels.json"
PROLOGUE = "h200-2026-12-02-qwen-peers/rope-real/prologue.json"
GROUPED_GEMM = ("h200-2026-12-01-moe-targets/grouped_gemm_flatten.json",
                "h200-2026-12-01-moe-targets/grouped_gemm_sweep_flatten.json")
MOE_DECODE = ("h200-2026-12-01-moe-targets/bench_moe.json", "h200-2026-12-01-moe-targets/bench_moe_decode_profile.json",
              "h200-2026-12-01-moe-targets/bench_moe_decode_profile_t1_rerun.json")
# ---- FP8 kernels on Hopper, one H100 -----------------------------------------------------------------------
_HOPPER = "h100-2026-12-05-hopper-profile"
HOPPER_GEMM = tuple(f"{_HOPPER}/{name}.json" for name in ("grouped_gemm_1", "grouped_gemm_sweep", "grouped_gemm_2"))
_HOPPER_ATTENTION = tuple(f"{_HOPPER}/fp8_attention_{i}.json" for i in (1, 2, 3, 4))
# each shape's runs, the last with the floors (the fourth run timed two shapes)
HOPPER_ATTENTION = {shape: _HOPPER_ATTENTION[:4 if shape in ("1.3B", "hy-t2i") else 3]
                    for shape in ("1.3B", "14B", "hy-t2i", "hy-ti2i")}
HOPPER_GEMV = f"{_HOPPER}/gemv_sweep.json"
# ---- HunyuanImage-3.0, two H200s ------------------------------------------------------------------------
TP2_32 = "h200x2-2026-11-30-plans/tp2_32.json"
TP2_16, HYBRID2_16 = "h200x2-2026-11-30-plans/tp2_16.json", "h200x2-2026-11-30-plans/hybrid2_16.json"
REGIONS_COLD = "h200x2-2026-12-01-regions/tp2_32_regions.json"
REGIONS_WARM = "h200x2-2026-12-01-regions/tp2_32_regions_warm.json"
# ---- HunyuanImage-3.0, CPU ------------------------------------------------------------------------------
STEP_CACHE_DEVIATION = "cpu-2026-12-01-step-cache/deviation.json"
COMPILE_DEPTH = "compile-cpu-2026-11-30.json"
SERVE_LOAD = "cpu-2026-12-05-serve-load/bench_serve_3_levels.json"
# ---- Wan ---------------------------------------------------------------------------------------------------
WAN_PEERS = ("h200-2026-12-03-fp8-attention/default-tiles/wan_peers.json",
             "h200-2026-12-03-side-stream-cfg/long-key-tiles/wan_peers.json")
WAN_STEP = "h200-2026-12-01-wan/bench_wan_1.3B.json"
WAN_14B_STEP = "h200-2026-12-01-wan/bench_wan_14B_8layers.json"
WAN_CACHE = "h200-2026-12-01-step-cache/bench_wan_cache.json"
WAN_CACHE_DEVIATION = "cpu-2026-12-01-wan-cache/deviation.json"
LORA_BATCH_WAN = "cpu-2026-12-05-lora/batch_wan.json"
LORA_BATCH_QWEN = "cpu-2026-12-05-lora/batch_qwen.json"
LORA_LOAD_CPU = "cpu-2026-12-05-lora/load_wan_14B_width_2_blocks.json"
# ---- Qwen-Image ----------------------------------------------------------------------------------------------
QWEN_BF16 = tuple(f"h200-2026-12-02-qwen-peers/rope-real/qwen_peers_{i}.json" for i in (1, 2, 3))
QWEN_FP8 = "h200-2026-12-03/serve-peers/qwen_peers_1.json"

# one request at the released shapes (random weights): FP8 experts, dense linears and attention, compiled regions
HY_REQUEST = ("python -m bench e2e cli --random-weights full --moe-dtype fp8 --dense-dtype fp8 --attention-dtype fp8 "
              "--compile --max-new-tokens 256 --ignore-eos --steps 10")
T2I_CMD = f"{HY_REQUEST} --prompt-tokens 1251 --image-size 1024x1024 --report t2i.json"
TI2I_CMD = (f"{HY_REQUEST} --image ref.png --prompt redder --prompt redder --kv-caches keep-ar --vae-dtype bfloat16 "
            "--vae-chunks 4 --report ti2i.json")
MOE = "python -m bench kernels moe"

RUNS: dict[str, RunInfo] = {
    DECODE: RunInfo("python -m bench decode step --layers 32 --moe-dtype fp8 --dense-dtype fp8 --decode-impls triton "
                    "--tokens 64 --kernels 12 --out decode.json", software=GPU_IMAGE),
    T2I: RunInfo(T2I_CMD, software=GPU_IMAGE),
    TI2I: RunInfo(TI2I_CMD, software=GPU_IMAGE),
    T2I_CFG_BATCH: RunInfo(f"{T2I_CMD} --cfg-mode batch", software=GPU_IMAGE),
    TI2I_CFG_BATCH: RunInfo(f"{TI2I_CMD} --cfg-mode batch", software=GPU_IMAGE),
    MEMORY: RunInfo("python -m bench memory levers --configs lean_ar --dense-dtype fp8 --repeats 3 --out memory.json",
                    software=GPU_IMAGE),
    STEP_CACHE: RunInfo("python -m bench step-cache hunyuan --model t2i --out step_cache_t2i.json"),
    DISTIL: RunInfo("python -m bench step-cache hunyuan --model distil --out step_cache_distil.json"),
    VAE_SUITE: RunInfo("python -m bench vae decode --suite --only-bf16 --variants bf16_fast_eager,bf16_cl_eager,"
                       "bf16_fast_chunks4_eager,bf16_cl_chunks4_eager --out vae_suite.json", software=GPU_IMAGE),
    VAE_FLOPS: RunInfo("python -m bench vae flops --sizes 1024 --out vae_flops.json", software=CPU_STACK),
    SERVE: RunInfo("python -m bench serve server --overhead-requests 5 --requests 0 --steps 10 --max-new-tokens 256 "
                   "--size 1024x1024 --timeout 300 --out serve.json -- --random-weights full --moe-dtype fp8 --compile",
                   software=GPU_IMAGE),
    ATTENTION: RunInfo("python -m bench kernels fp8-attention --shapes 1.3B,hy-t2i,hy-ti2i --sweep --iters 10 "
                       "--out fp8_attention.json", software=GPU_IMAGE),
    ATTENTION_14B: RunInfo("python -m bench kernels fp8-attention --shapes 14B --iters 5 --out fp8_attention_14b.json",
                           software=GPU_IMAGE),
    SPLIT_KV: RunInfo("python -m bench kernels split-kv --out split_kv.json", software=GPU_IMAGE),
    PROLOGUE: RunInfo("python -m bench kernels prologue --out prologue.json", software=GPU_IMAGE),
    GROUPED_GEMM[0]: RunInfo("python -m bench kernels grouped-gemm --flatten --out grouped_gemm.json"),
    GROUPED_GEMM[1]: RunInfo("python -m bench kernels grouped-gemm --flatten --sweep --out grouped_gemm_sweep.json"),
    MOE_DECODE[0]: RunInfo(f"{MOE} --decode-tokens 1 16 --out moe.json"),
    MOE_DECODE[1]: RunInfo(f"{MOE} --part decode --decode-tokens 1 16 --profile-decode --out moe_decode.json"),
    MOE_DECODE[2]: RunInfo(f"{MOE} --part decode --decode-tokens 1 --decode-kinds fp8_channels --profile-decode "
                           "--out moe_decode_t1.json"),
    HOPPER_GEMM[0]: RunInfo("python -m bench kernels grouped-gemm --only scaled-grouped-mm --out grouped_gemm.json"),
    HOPPER_GEMM[1]: RunInfo("python -m bench kernels grouped-gemm --only scaled-grouped-mm --sweep "
                            "--out grouped_gemm_sweep.json"),
    HOPPER_GEMM[2]: RunInfo("python -m bench kernels grouped-gemm --only scaled-grouped-mm --out grouped_gemm.json"),
    **{f: RunInfo("python -m bench kernels fp8-attention --kernels-only --iters 5 --out fp8_attention.json")
       for f in _HOPPER_ATTENTION[:3]},
    _HOPPER_ATTENTION[3]: RunInfo("python -m bench kernels fp8-attention --kernels-only --iters 5 --shapes 1.3B,hy-t2i "
                                  "--out fp8_attention.json"),
    HOPPER_GEMV: RunInfo("python -m bench kernels gemv --kinds fp8 --sweep --out gemv_sweep.json"),
    TP2_32: RunInfo("python -m bench run-all e2e:t2i_tp2_32"),
    TP2_16: RunInfo("python -m bench run-all e2e:t2i_tp2_16"),
    HYBRID2_16: RunInfo("python -m bench run-all e2e:t2i_hybrid2_16"),
    REGIONS_COLD: RunInfo("python -m bench run-all e2e:t2i_tp2_32 (an empty compile cache)"),
    REGIONS_WARM: RunInfo("python -m bench run-all e2e:t2i_tp2_32 (again: the first run's compile cache)"),
    STEP_CACHE_DEVIATION: RunInfo("python -m bench step-cache hunyuan --deviation --out deviation.json"),
    COMPILE_DEPTH: RunInfo("python -m bench compile depth --layers 2,16 --modes regions,whole --out compile_depth.json",
                           software=CPU_STACK),
    SERVE_LOAD: RunInfo("python -m bench serve server --requests 40 --overhead-requests 0 --budget 1000 "
                        "--out bench_serve_3_levels.json", software=CPU_STACK),
    WAN_PEERS[0]: RunInfo("python -m bench peers wan --models 1.3B,14B-8 --modes regions --variants bf16,attn-fp8,fp8 "
                          "--out wan_peers.json", software=WITH_DIFFUSERS),
    WAN_PEERS[1]: RunInfo("python -m bench peers wan --models 1.3B,14B-8 --modes regions --variants bf16,attn-fp8 "
                          "--profile 12 --out wan_peers.json", software=WITH_DIFFUSERS),
    WAN_STEP: RunInfo("python -m bench dit wan --model 1.3B --out wan_1.3B.json"),
    WAN_14B_STEP: RunInfo("python -m bench dit wan --model 14B --layers 8 --out wan_14B_8layers.json"),
    WAN_CACHE: RunInfo("python -m bench step-cache wan --out wan_cache.json", software=WITH_DIFFUSERS),
    WAN_CACHE_DEVIATION: RunInfo("python -m bench step-cache wan-deviation --out deviation.json"),
    LORA_BATCH_WAN: RunInfo("python -m bench lora batch --model wan --threads 1 --repeats 7 "
                            "--out batch_wan.json"),
    LORA_BATCH_QWEN: RunInfo("python -m bench lora batch --model qwen-image --threads 1 --repeats 7 "
                             "--out batch_qwen.json"),
    LORA_LOAD_CPU: RunInfo("python -m bench lora load --cpu --size 14B --layers 2 --threads 1 "
                           "--out load_wan_14B_width_2_blocks.json"),
    **{f: RunInfo("python -m bench peers qwen --modes regions --kernels 12 --out qwen_peers.json",
                  software=WITH_DIFFUSERS) for f in QWEN_BF16},
    QWEN_FP8: RunInfo("python -m bench peers qwen --modes regions --variants bf16,dense-fp8,attn-fp8,fp8 "
                      "--out qwen_peers.json", software=WITH_DIFFUSERS),
}

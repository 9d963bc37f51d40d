"""Every JSON a table reads (its path under bench/results/) and the command that made it: `RUNS`."""
from __future__ import annotations

from bench.report_cells import RunInfo


GPU_IMAGE = "torch 2.11.0+cu130, triton 3.6.0"
CPU_STACK = "torch 2.13.0+cpu, triton 3.9.0"
T2I_2LAYERS = ("python -m examples.hunyuan_t2i --random-weights full --layers 2 --plan single --prompt-tokens 1251 "
               "--ignore-eos --image-size 1024x1024")

# ---- the folders (bench/results/<machine>-<date>[-topic]/) and the files the tables read -----------------
H1129, H1129_LAYERS = "h200-2026-11-29", "h200-2026-11-29-layers"
X2_1130, X2_PLANS, X2_REGIONS_1130 = "h200x2-2026-11-30", "h200x2-2026-11-30-plans", "h200x2-2026-11-30-regions"
X2_REGIONS_1201, X2_FP8_DECODE = "h200x2-2026-12-01-regions", "h200x2-2026-12-01-fp8-decode"
MOE_1201, FP8_EXPERTS, MOE_TARGETS = "h200-2026-12-01-moe", "h200-2026-12-01-fp8-experts", "h200-2026-12-01-moe-targets"
REGIONS_TI2I, WAN_1201 = "h200-2026-12-01-regions-ti2i", "h200-2026-12-01-wan"
SERVE = "cpu-2026-12-01-serve/bench_serve.json"
SERVE_LOAD = "cpu-2026-12-02-serve-load-trim/bench_serve.json"
STEP_CACHE_1201 = "h200-2026-12-01-step-cache"
STEP_CACHE_T2I = f"{STEP_CACHE_1201}/step_cache_t2i_ti2i.json"
STEP_CACHE_DISTIL = f"{STEP_CACHE_1201}/step_cache_distil.json"
STEP_CACHE_DEVIATION = "cpu-2026-12-01-step-cache/deviation.json"
WAN_CACHE, SECOND_REQUEST = f"{STEP_CACHE_1201}/bench_wan_cache.json", f"{STEP_CACHE_1201}/second_request.json"
CPU_COMPILE = "compile-cpu-2026-11-30.json"

H1202 = "h200-2026-12-02"
H1202_DECODE_KERNELS, H1202_WAN_PEERS = f"{H1202}/decode_kernels.json", f"{H1202}/bench_peers.json"
H1202_FP8_ATTENTION, H1202_MEMORY_PROBE = f"{H1202}/bench_fp8_attention.json", f"{H1202}/memory_vae_probe.json"
H1202_BATCH_PARITY = f"{H1202}/batch_parity.json"
H1202_LEVERS, H1202_T2I_DENSE_FP8 = f"{H1202}/levers-batch/bench_memory.json", f"{H1202}/levers-batch/t2i_dense_fp8.json"
H1202_BATCH, H1202_DECODE_STEP = f"{H1202}/levers-batch/bench_batch.json", f"{H1202}/levers-batch/decode_step.json"
DECODE_KERNELS = "h200-2026-12-02-decode-kernels"
DECODE_BEFORE_SMALL_KERNELS = f"{DECODE_KERNELS}/before-small-kernels/decode_fp8.json"
DECODE_SMALL_KERNELS_BF16 = f"{DECODE_KERNELS}/small-kernels/decode_bf16.json"
DECODE_SMALL_KERNELS_FP8 = f"{DECODE_KERNELS}/small-kernels/decode_dense_fp8.json"
GEMV_1202 = f"{DECODE_KERNELS}/small-kernels/bench_decode_gemv.json"
QWEN_PEERS_FIRST = f"{DECODE_KERNELS}/small-kernels/qwen_peers.json"
QWEN_PEERS_1202 = "h200-2026-12-02-qwen-peers"
DECODE_GEMV_DEFAULT = f"{QWEN_PEERS_1202}/gemv-default/decode_dense_fp8.json"
DECODE_GEMV_SWEPT = f"{QWEN_PEERS_1202}/gemv-swept/decode_dense_fp8.json"
T2I_GEMV_DEFAULT_BF16 = f"{QWEN_PEERS_1202}/gemv-default/t2i_bf16.json"
T2I_GEMV_DEFAULT_FP8 = f"{QWEN_PEERS_1202}/gemv-default/t2i_dense_fp8.json"
QWEN_PEERS_BIAS_OUTSIDE = f"{QWEN_PEERS_1202}/gemv-default/qwen_peers.json"
QWEN_PEERS_BIAS_IN_GEMM = [f"{QWEN_PEERS_1202}/bias-in-gemm/qwen_peers_{i}.json" for i in (1, 2)]
QWEN_PEERS_ROPE_REAL = [f"{QWEN_PEERS_1202}/rope-real/qwen_peers_{i}.json" for i in (1, 2, 3)]
PROLOGUE_SWEEP = f"{QWEN_PEERS_1202}/bias-in-gemm/prologue.json"
PROLOGUE_PREFILL = f"{QWEN_PEERS_1202}/rope-real/prologue.json"
GEMV_SWEEP = f"{QWEN_PEERS_1202}/rope-real/bench_decode_gemv.json"
SERVE_OVERHEAD_1202 = f"{QWEN_PEERS_1202}/gemv-swept/bench_serve.json"
SERVE_WAKEUP_CPU = ["cpu-2026-12-02-serve-wakeup/before_wakeup.json", "cpu-2026-12-02-serve-wakeup/after_wakeup.json"]
PNG_CPU = "cpu-2026-12-02-png"
PNG_ON_CPU, SERVE_PNG_CPU = f"{PNG_CPU}/bench_image_files.json", f"{PNG_CPU}/bench_serve_overhead.json"
VAE_FLOPS = "cpu-2026-12-02-vae/vae_flops.json"

H1203 = "h200-2026-12-03"
DECODE_LM_HEAD_FP8, T2I_LM_HEAD_FP8 = f"{H1203}/lm-head-fp8/decode_dense_fp8.json", f"{H1203}/lm-head-fp8/t2i_dense_fp8.json"
MEMORY_LEAN, VAE_CONV = f"{H1203}/lm-head-fp8/bench_memory.json", f"{H1203}/lm-head-fp8/vae_conv_probe.json"
SERVE_OVERHEAD_1203 = f"{H1203}/serve-peers/bench_serve.json"
PNG_H200_HOST = f"{H1203}/serve-peers/bench_image_files.json"
MEMORY_LEAN_MEASURED = f"{H1203}/serve-peers/bench_memory.json"
QWEN_FP8, WAN_PEERS_COMPILED_QUANT = f"{H1203}/serve-peers/qwen_peers_1.json", f"{H1203}/serve-peers/wan_peers.json"
KEEP_AR = "h200-2026-12-03-keep-ar"
MEMORY_KV_POLICY, TI2I_KV_POLICY = f"{KEEP_AR}/kv-policy/bench_memory.json", f"{KEEP_AR}/kv-policy/ti2i_dense_fp8.json"
VAE_SUITE_KV_POLICY = f"{KEEP_AR}/kv-policy/bench_vae_suite.json"
DECODE_FUSIONS, MEMORY_FUSIONS = f"{KEEP_AR}/fusions/decode_dense_fp8.json", f"{KEEP_AR}/fusions/bench_memory.json"
VAE_SUITE_FUSIONS = f"{KEEP_AR}/fusions/bench_vae_suite.json"
DECODE_FUSIONS_REVERTED = f"{KEEP_AR}/fusions-reverted/decode_dense_fp8.json"
MEMORY_FUSIONS_REVERTED = f"{KEEP_AR}/fusions-reverted/bench_memory.json"
TI2I_LEAN = f"{KEEP_AR}/ti2i-lean/ti2i_dense_fp8.json"
FP8_ATTENTION_1203 = "h200-2026-12-03-fp8-attention"
ATTENTION_SWEEP_FIRST = f"{FP8_ATTENTION_1203}/sweep-first-kernel/bench_fp8_attention_sweep.json"
ATTENTION_SWEEP = f"{FP8_ATTENTION_1203}/sweep/bench_fp8_attention_sweep.json"
ATTENTION_DEFAULT_TILES = f"{FP8_ATTENTION_1203}/default-tiles/bench_fp8_attention_sweep.json"
WAN_PEERS_FP8_KERNEL = f"{FP8_ATTENTION_1203}/default-tiles/wan_peers.json"
DECODE_PDL = tuple(f"{FP8_ATTENTION_1203}/decode-pdl/decode_dense_fp8_{run}.json"
                   for run in ("pdl1_34", "pdl0_80", "pdl1_112"))   # PDL on, off, on
T2I_ATTENTION_FP8 = f"{FP8_ATTENTION_1203}/hy-attention-fp8/t2i_attn_fp8.json"
TI2I_ATTENTION_FP8 = f"{FP8_ATTENTION_1203}/hy-attention-fp8/ti2i_attn_fp8.json"
SIDE_STREAM_CFG = "h200-2026-12-03-side-stream-cfg"
DECODE_SIDE_STREAM_SUNK = f"{SIDE_STREAM_CFG}/side-stream-sunk/decode_dense_fp8.json"
DECODE_SIDE_STREAM_FIRST = f"{SIDE_STREAM_CFG}/side-stream-first/decode_dense_fp8.json"
T2I_CFG_BATCH, TI2I_CFG_BATCH = f"{SIDE_STREAM_CFG}/cfg-batch/t2i_cfg_batch.json", f"{SIDE_STREAM_CFG}/cfg-batch/ti2i_cfg_batch.json"
ATTENTION_LAZY = f"{SIDE_STREAM_CFG}/lazy-rescale/bench_fp8_attention_sweep.json"
WAN_PEERS_LONG_KEYS = f"{SIDE_STREAM_CFG}/long-key-tiles/wan_peers.json"
ATTENTION_14B_LONG_KEYS = f"{SIDE_STREAM_CFG}/long-key-tiles/bench_fp8_attention_14b.json"
ATTENTION_SASS = "cpu-2026-12-03-attention-sass/fp8_attention_sass.json"

_VAE_CL_VARIANTS = ("bf16_fast_eager,bf16_cl_eager,bf16_cl_cached_eager,bf16_fast_chunks4_eager,bf16_cl_chunks4_eager,"
                    "enc_bf16_fast_eager,enc_bf16_cl_eager,enc_bf16_fast_chunks4_eager,enc_bf16_cl_chunks4_eager,"
                    "bf16_cl_compiled")
# bench_decode's dense-FP8 run, as the GPU runner's decode step runs it
DECODE_FP8_CMD = ("python -m bench.bench_decode --layers 32 --moe-dtype fp8 --dense-dtype fp8 --decode-impls triton "
                  "--tokens 64 --kernels 12")

RUNS: dict[str, RunInfo] = {
    # one H200, 2026-12-02
    H1202_DECODE_KERNELS: RunInfo("python -m bench.bench_decode_batch --parts kernel,prologue --out /root/out/kernels.json",
                        software=GPU_IMAGE),
    H1202_WAN_PEERS: RunInfo("python -m bench.bench_peers --models 1.3B,14B-8 --modes eager,regions --variants "
                       "bf16,dense-fp8,attn-fp8,fp8 --out /root/out/fp8/bench_peers.json",
                       software=f"{GPU_IMAGE}, diffusers 0.42.1"),
    H1202_FP8_ATTENTION: RunInfo("python -m bench.bench_fp8_attention --out /root/out/fp8/bench_fp8_attention.json",
                               software=GPU_IMAGE),
    H1202_MEMORY_PROBE: RunInfo("python -m bench.probes.memory_vae_probe --out $OUT"),
    H1202_LEVERS: RunInfo("python -m bench.bench_memory --configs baseline,all_fp32_vae,all --runs t2i,ti2i "
                        "--out /root/out/bench_memory.json", software=GPU_IMAGE),
    # an examples.hunyuan_t2i report holds no command: this is the GPU runner's step t2i_dense_fp8
    H1202_T2I_DENSE_FP8: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --dense-dtype fp8 "
                           "--compile --prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 "
                           "--steps 10 --kv-caches release --vae-dtype bfloat16 --vae-chunks 4 "
                           "--moe-token-chunk 2048 --report $OUT/t2i_dense_fp8.json --output $OUT/t2i_dense_fp8.png",
                           software=GPU_IMAGE),
    H1202_BATCH: RunInfo("python -m bench.bench_batch --steps 10 --repeats 1 --out /root/out/bench_batch.json"),
    H1202_BATCH_PARITY: RunInfo("python -m bench.probes.batch_parity_probe --layers 2 --out batch_parity.json",
                        software=GPU_IMAGE),
    H1202_DECODE_STEP: RunInfo("python -m bench.bench_decode_batch --parts step --repeats 5 --step-iters 10 "
                      "--out /root/out/decode_step.json", software=GPU_IMAGE),
    # one H200, 2026-12-02
    DECODE_BEFORE_SMALL_KERNELS: RunInfo("python -m bench.bench_decode --layers 32 --moe-dtype fp8 --decode-impls triton,sdpa "
                               "--tokens 64 --kernels 40 --out $OUT/decode_fp8.json"),
    DECODE_SMALL_KERNELS_BF16: RunInfo("python -m bench.bench_decode "
                             "--layers 32 --moe-dtype fp8 --decode-impls triton --tokens 64 --kernels 12"),
    DECODE_SMALL_KERNELS_FP8: RunInfo("python -m bench.bench_decode "
                            "--layers 32 --moe-dtype fp8 --dense-dtype fp8 --decode-impls triton --tokens 64 --kernels 12"),
    GEMV_1202: RunInfo("python -m bench.bench_decode_gemv"),
    QWEN_PEERS_FIRST: RunInfo("python -m bench.bench_qwen_peers --modes eager,regions (diffusers 0.42.1 carried)"),
    # one H200, 2026-12-02
    DECODE_GEMV_DEFAULT: RunInfo("python -m bench.bench_decode --layers 32 --moe-dtype fp8 "
                                "--dense-dtype fp8 --decode-impls triton --tokens 64 --kernels 12", software=GPU_IMAGE),
    DECODE_GEMV_SWEPT: RunInfo("python -m bench.bench_decode --layers 32 --moe-dtype fp8 "
                              "--dense-dtype fp8 --decode-impls triton --tokens 64 --kernels 12", software=GPU_IMAGE),
    **{f: RunInfo(f"python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                  f"--prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10{extra}",
                  software=GPU_IMAGE)
       for f, extra in ((T2I_GEMV_DEFAULT_BF16, ""), (T2I_GEMV_DEFAULT_FP8, " --dense-dtype fp8"))},
    QWEN_PEERS_BIAS_OUTSIDE: RunInfo("python -m bench.bench_qwen_peers --modes regions --kernels 15",
                              software=f"{GPU_IMAGE}, diffusers 0.42.1"),
    **{f: RunInfo("python -m bench.bench_qwen_peers --modes eager,regions --kernels 12",
                  software=f"{GPU_IMAGE}, diffusers 0.42.1") for f in QWEN_PEERS_BIAS_IN_GEMM},
    **{f: RunInfo("python -m bench.bench_qwen_peers --modes regions --kernels 12",
                  software=f"{GPU_IMAGE}, diffusers 0.42.1") for f in QWEN_PEERS_ROPE_REAL},
    PROLOGUE_SWEEP: RunInfo("python -m bench.bench_decode_batch --parts prologue --prologue-rows "
                                "1,2,4,8,16,32 --prologue-warps 4,8,16", software=GPU_IMAGE),
    PROLOGUE_PREFILL: RunInfo("python -m bench.bench_decode_batch --parts prologue", software=GPU_IMAGE),
    GEMV_SWEEP: RunInfo("python -m bench.bench_decode_gemv --sweep --rows 1 --sweep-budget-s 50",
                      software=GPU_IMAGE),
    SERVE_OVERHEAD_1202: RunInfo("python -m bench.bench_serve --overhead-requests 3 --requests 0 --steps 10 "
                       "--max-new-tokens 256 --size 1024x1024 --timeout 300 -- --random-weights full --moe-dtype fp8 "
                       "--compile", software=GPU_IMAGE),
    SERVE_PNG_CPU: RunInfo("python -m bench.bench_serve --overhead-requests 5 --requests 0 --out "
                           "bench/results/cpu-2026-12-02-png/bench_serve_overhead.json", software=CPU_STACK),
    PNG_ON_CPU: RunInfo("python -m bench.bench_image_files --out bench/results/cpu-2026-12-02-png/bench_image_files.json",
                     software=CPU_STACK),
    VAE_FLOPS: RunInfo("python -m bench.probes.vae_flops --sizes 1024 --out "
                           "bench/results/cpu-2026-12-02-vae/vae_flops.json", software=CPU_STACK),
    **{f: RunInfo(f"python -m bench.bench_serve --overhead-requests {n} --requests 0 --out bench_serve.json",
                  software=CPU_STACK) for f, n in zip(SERVE_WAKEUP_CPU, (2, 3))},
    # one H200, 2026-12-03
    DECODE_LM_HEAD_FP8: RunInfo(DECODE_FP8_CMD, software=GPU_IMAGE),
    # an examples.hunyuan_t2i report holds no command: the GPU runner's t2i step
    T2I_LM_HEAD_FP8: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                     "--prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 "
                     "--profile /tmp/prof --profile-steps 2 --profile-top 40 --dense-dtype fp8 "
                     "--report $OUT/t2i_dense_fp8.json --output /tmp/t2i_dense_fp8.png", software=GPU_IMAGE),
    MEMORY_LEAN: RunInfo("python -m bench.bench_memory --configs lean --dense-dtype fp8",
                        software=GPU_IMAGE),
    VAE_CONV: RunInfo("python -m bench.probes.vae_conv_probe --out $OUT/vae_conv_probe.json",
                          software=GPU_IMAGE),
    # one H200, 2026-12-03
    PNG_H200_HOST: RunInfo("python -m bench.bench_image_files --out $OUT/bench_image_files.json",
                     gpu="the 1 x H200 host's CPU", software=GPU_IMAGE),
    SERVE_OVERHEAD_1203: RunInfo("python -m bench.bench_serve --overhead-requests 5 --requests 0 --steps 10 "
                       "--max-new-tokens 256 --size 1024x1024 --timeout 300 -- --random-weights full --moe-dtype fp8 "
                       "--compile", software=GPU_IMAGE),
    MEMORY_LEAN_MEASURED: RunInfo("python -m bench.bench_memory --configs lean --dense-dtype fp8",
                                 software=GPU_IMAGE),
    QWEN_FP8: RunInfo("python -m bench.bench_qwen_peers --modes regions --variants "
                          "bf16,dense-fp8,attn-fp8,fp8", software=f"{GPU_IMAGE}, diffusers 0.42.1"),
    WAN_PEERS_COMPILED_QUANT: RunInfo("python -m bench.bench_peers --models 1.3B,14B-8 --modes regions --variants "
                           "bf16,dense-fp8,attn-fp8,fp8", software=f"{GPU_IMAGE}, diffusers 0.42.1"),
    # one H200, 2026-12-03
    MEMORY_KV_POLICY: RunInfo("python -m bench.bench_memory --configs lean,lean_ar --dense-dtype fp8 "
                         "--repeats 2", software=GPU_IMAGE),
    TI2I_KV_POLICY: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                       "--dense-dtype fp8 --image /tmp/ti2i_ref.png --max-new-tokens 256 --ignore-eos --steps 10 "
                       "--profile /tmp/prof --profile-steps 2 --profile-top 40 --report $OUT/ti2i_dense_fp8.json "
                       "--output /tmp/ti2i_dense_fp8.png", software=GPU_IMAGE),
    DECODE_FUSIONS: RunInfo(DECODE_FP8_CMD, software=GPU_IMAGE),
    MEMORY_FUSIONS: RunInfo("python -m bench.bench_memory --configs lean_ar --dense-dtype fp8 --repeats 2",
                         software=GPU_IMAGE),
    VAE_SUITE_FUSIONS: RunInfo(f"python -m bench.bench_vae --suite --only-bf16 --variants {_VAE_CL_VARIANTS}",
                      software=GPU_IMAGE),
    DECODE_FUSIONS_REVERTED: RunInfo(DECODE_FP8_CMD, software=GPU_IMAGE),
    MEMORY_FUSIONS_REVERTED: RunInfo("python -m bench.bench_memory --configs lean_ar --dense-dtype fp8 --repeats 3",
                         software=GPU_IMAGE),
    TI2I_LEAN: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                       "--dense-dtype fp8 --image /tmp/ti2i_ref.png --max-new-tokens 256 --ignore-eos --steps 10 "
                       "--prompt redder --prompt redder --kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4 "
                       "--report $OUT/ti2i_dense_fp8.json --output /tmp/ti2i_dense_fp8.png", software=GPU_IMAGE),
    VAE_SUITE_KV_POLICY: RunInfo("python -m bench.bench_vae --suite --out $OUT/bench_vae_suite.json",
                      software=GPU_IMAGE),
    # one H200, 2026-12-03
    ATTENTION_SWEEP_FIRST: RunInfo("python -m bench.bench_fp8_attention --sweep --iters 10 --out "
                      "$OUT/bench_fp8_attention_sweep.json", software=GPU_IMAGE),
    ATTENTION_SWEEP: RunInfo("python -m bench.bench_fp8_attention --sweep --iters 10 --out "
                      "$OUT/bench_fp8_attention_sweep.json", software=GPU_IMAGE),
    ATTENTION_DEFAULT_TILES: RunInfo("python -m bench.bench_fp8_attention --shapes 1.3B,hy-t2i,hy-ti2i --sweep --iters 10 "
                                     "--out $OUT/bench_fp8_attention_sweep2.json", software=GPU_IMAGE),
    WAN_PEERS_FP8_KERNEL: RunInfo("python -m bench.bench_peers --models 1.3B,14B-8 --modes regions "
                           "--variants bf16,attn-fp8,fp8", software=f"{GPU_IMAGE}, diffusers 0.42.1"),
    **{f: RunInfo(f"for pdl in 1 0 1; do DTGEN_DECODE_PDL=$pdl {DECODE_FP8_CMD}; done (the PDL commit 4e2578b, "
                  "reverted in 3e793c6)", software=GPU_IMAGE) for f in DECODE_PDL},
    T2I_ATTENTION_FP8: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                      "--prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 "
                      "--attention-dtype fp8 --dense-dtype fp8 --report $OUT/t2i_dense_fp8.json", software=GPU_IMAGE),
    TI2I_ATTENTION_FP8: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                       "--dense-dtype fp8 --image /tmp/ti2i_ref.png --max-new-tokens 256 --ignore-eos --steps 10 "
                       "--prompt redder --prompt redder --kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4 "
                       "--attention-dtype fp8 --report $OUT/ti2i_dense_fp8.json", software=GPU_IMAGE),
    # one H200, 2026-12-03
    **{f: RunInfo(f"{DECODE_FP8_CMD} --shared-expert beside,inline,beside (the side-stream commit "
                  f"f694790, {what}; reverted in ffe0a5b)", software=GPU_IMAGE)
       for f, what in ((DECODE_SIDE_STREAM_SUNK, "its side op sunk by inductor to the join"),
                       (DECODE_SIDE_STREAM_FIRST, "the side op first, the join after the routed experts"))},
    T2I_CFG_BATCH: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                      "--prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 "
                      "--attention-dtype fp8 --cfg-mode batch --dense-dtype fp8 --report $OUT/t2i_dense_fp8.json",
                      software=GPU_IMAGE),
    TI2I_CFG_BATCH: RunInfo("python -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile "
                       "--dense-dtype fp8 --image /tmp/ti2i_ref.png --max-new-tokens 256 --ignore-eos --steps 10 "
                       "--prompt redder --prompt redder --kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4 "
                       "--attention-dtype fp8 --cfg-mode batch --report $OUT/ti2i_dense_fp8.json", software=GPU_IMAGE),
    ATTENTION_LAZY: RunInfo("python -m pytest -q -m gpu tests/wan/test_fp8_attention.py; python -m bench.bench_fp8_attention "
                      "--shapes 1.3B,hy-t2i --sweep --iters 10 (the lazy-rescale commit 3e083ca, reverted after it)",
                      software=GPU_IMAGE),
    WAN_PEERS_LONG_KEYS: RunInfo("python -m bench.bench_peers --models 1.3B,14B-8 --modes regions --variants bf16,attn-fp8 "
                                 "--profile 12", software=f"{GPU_IMAGE}, diffusers 0.42.1"),
    ATTENTION_14B_LONG_KEYS: RunInfo("python -m bench.bench_fp8_attention --shapes 14B --iters 5", software=GPU_IMAGE),
    ATTENTION_SASS: RunInfo("TRITON_INTERPRET=0 PYTHONPATH=<a triton 3.6.0 wheel unpacked> python -m "
                      "bench.probes.fp8_attention_sass --out bench/results/cpu-2026-12-03-attention-sass/fp8_attention_sass.json",
                      gpu="none: compiled for sm_90 on the CPU", software="triton 3.6.0 (the GPU machines' version)"),
    # one H200, 2026-12-01
    STEP_CACHE_T2I: RunInfo("python -m bench.bench_step_cache --model t2i --out step_cache_t2i_ti2i.json"),
    STEP_CACHE_DISTIL: RunInfo("python -m bench.bench_step_cache --model distil --out step_cache_distil.json"),
    STEP_CACHE_DEVIATION: RunInfo("python -m bench.bench_step_cache --deviation --out "
                                  "bench/results/cpu-2026-12-01-step-cache/deviation.json"),
    WAN_CACHE: RunInfo("python -m bench.bench_wan_cache --out bench_wan_cache.json (diffusers 0.42.1 carried)"),
    SECOND_REQUEST: RunInfo("python -m bench.second_request --out second_request.json --profile",
                            software=GPU_IMAGE),
    # one H200, 2026-11-29. The runners these entries name (bench/run_gpu2.sh, bench/run_gpu_fp8.sh) are in git
    # history: bench/run_gpu.sh, one runner for every suite, replaced them; a command stays as it was run.
    f"{H1129}/bench_layers.json": RunInfo("python -m bench.bench_layers --profile"),
    f"{H1129}/bench_moe.json": RunInfo("python -m bench.bench_moe"),
    f"{H1129}/bench_attention.json": RunInfo("python -m bench.bench_attention"),
    f"{H1129}/t2i_full_2layers.json": RunInfo(f"{T2I_2LAYERS} --max-new-tokens 256 --steps 10", software=GPU_IMAGE),
    f"{H1129}/t2i_full_2layers_compiled.json": RunInfo(f"{T2I_2LAYERS} --max-new-tokens 256 --steps 10 --compile",
                                                    software=GPU_IMAGE),
    f"{H1129_LAYERS}/bench_layers_op_path.json": RunInfo("python -m bench.bench_layers --profile"),
    f"{H1129_LAYERS}/bench_layers_traced_moe_inductor_finalize.json": RunInfo(
        "python -m bench.bench_layers --profile (MoE traced: impl graph, inductor's finalize)"),
    f"{H1129_LAYERS}/bench_grouped_gemm.json": RunInfo("python -m bench.bench_grouped_gemm --autotune"),
    f"{H1129_LAYERS}/bench_decode.json": RunInfo("python -m bench.bench_decode"),
    f"{H1129_LAYERS}/bench_decode_host_sampling.json": RunInfo("python -m bench.bench_decode (before: sampling on the host)"),
    f"{H1129_LAYERS}/t2i_full_2layers_compiled.json": RunInfo(
        f"{T2I_2LAYERS} --max-new-tokens 128 --steps 4 --compile --profile", software=GPU_IMAGE),
    # two H200s, 2026-11-30
    f"{X2_1130}/tp2_32.json": RunInfo("bash bench/run_gpu2.sh tp2-32 (its first version)"),
    f"{X2_PLANS}/table.json": RunInfo("python -m bench.gpu2_table outputs/gpu2 (over the reports of tp2-32 and cmp16)",
                                software=GPU_IMAGE),
    f"{X2_PLANS}/tp2_32.json": RunInfo("bash bench/run_gpu2.sh tp2-32"),
    f"{X2_PLANS}/tp2_16.json": RunInfo("bash bench/run_gpu2.sh cmp16"),
    f"{X2_PLANS}/hybrid2_16.json": RunInfo("bash bench/run_gpu2.sh cmp16"),
    **{f"{folder}/multigpu-{plan}-{dtype}.json": RunInfo("make test-gpu2 (tests/hunyuan_image3/multigpu_job.py)")
       for folder in (X2_1130, X2_PLANS) for plan in ("tp2", "hybrid2", "hybrid2-cfg") for dtype in ("float32", "bfloat16")},
    **{f"{X2_REGIONS_1201}/tp2+regions-{dtype}.json": RunInfo("make test-gpu2 (tests/hunyuan_image3/multigpu_job.py --regions)")
       for dtype in ("float32", "bfloat16")},
    f"{X2_REGIONS_1130}/tp2_32_regions.json": RunInfo("bash bench/run_gpu2.sh regions-32 (cold process)"),
    f"{X2_REGIONS_1130}/tp2_32_regions_warm.json": RunInfo("bash bench/run_gpu2.sh regions-32 (second process, warm cache)"),
    f"{X2_REGIONS_1130}/earlier_tp2_32_regions.json": RunInfo("bash bench/run_gpu2.sh regions-32 (cold; an earlier machine)"),
    f"{X2_REGIONS_1130}/earlier_tp2_32_regions_warm.json": RunInfo("bash bench/run_gpu2.sh regions-32 (warm; an earlier machine)"),
    f"{X2_REGIONS_1130}/bench_layers_hole_flash.json": RunInfo(
        "python -m bench.bench_layers --layer denoise (the key-prefix attention's impl forced to flash)"),
    f"{X2_REGIONS_1201}/tp2_32_regions.json": RunInfo("bash bench/run_gpu2.sh regions-32 (cold process; commit 3b99d10)"),
    f"{X2_REGIONS_1201}/tp2_32_regions_warm.json": RunInfo("bash bench/run_gpu2.sh regions-32 (warm cache; commit 3b99d10)"),
    # one H200, 2026-12-01
    f"{MOE_1201}/bench_grouped_gemm.json": RunInfo("python -m bench.bench_grouped_gemm --sweep"),
    f"{MOE_1201}/bench_moe_prefill.json": RunInfo("python -m bench.bench_moe --part prefill"),
    f"{MOE_1201}/bench_layers_denoise.json": RunInfo("python -m bench.bench_layers --layer denoise"),
    f"{FP8_EXPERTS}/bench_layers.json": RunInfo("python -m bench.bench_layers"),
    f"{FP8_EXPERTS}/bench_moe.json": RunInfo("python -m bench.bench_moe"),
    f"{FP8_EXPERTS}/bench_moe_decode.json": RunInfo("python -m bench.bench_moe --part decode"),
    f"{FP8_EXPERTS}/bench_grouped_gemm.json": RunInfo("python -m bench.bench_grouped_gemm --sweep"),
    f"{FP8_EXPERTS}/t2i_2layers_bf16.json": RunInfo("bash bench/run_gpu_fp8.sh e2e (bf16 experts)"),
    f"{FP8_EXPERTS}/t2i_2layers_fp8_channels.json": RunInfo("bash bench/run_gpu_fp8.sh e2e (--moe-dtype fp8)"),
    f"{REGIONS_TI2I}/single_16_regions.json": RunInfo("bash bench/run_gpu2.sh single-regions-16 (cold process)"),
    f"{REGIONS_TI2I}/single_16_regions_warm.json": RunInfo("bash bench/run_gpu2.sh single-regions-16 (warm cache)"),
    f"{REGIONS_TI2I}/startup_4layers_cold.json": RunInfo("python -m bench.startup_profile (4 layers, cold cache)"),
    f"{REGIONS_TI2I}/startup_4layers_warm.json": RunInfo("python -m bench.startup_profile (4 layers, warm cache)"),
    f"{REGIONS_TI2I}/ti2i_1gpu.json": RunInfo("bash bench/run_gpu2.sh ti2i-1gpu (eager)"),
    f"{REGIONS_TI2I}/ti2i_1gpu_compiled.json": RunInfo("bash bench/run_gpu2.sh ti2i-1gpu (--compile)"),
    f"{X2_FP8_DECODE}/bench_moe_decode.json": RunInfo("python -m bench.bench_moe --part decode", gpu="GPU 0 of 2 x H200"),
    f"{WAN_1201}/bench_wan_1.3B.json": RunInfo("python -m bench.bench_wan --model 1.3B"),
    f"{WAN_1201}/bench_wan_14B_8layers.json": RunInfo("python -m bench.bench_wan --model 14B --layers 8"),
    f"{WAN_1201}/wan_tiny.json": RunInfo("python -m examples.wan_t2v --compile"),
    f"{MOE_TARGETS}/bench_moe.json": RunInfo("python -m bench.bench_moe --decode-tokens 1 16"),
    f"{MOE_TARGETS}/bench_moe_decode_profile.json": RunInfo(
        "python -m bench.bench_moe --part decode --decode-tokens 1 16 --profile-decode"),
    f"{MOE_TARGETS}/bench_moe_decode_profile_t1_rerun.json": RunInfo(
        "python -m bench.bench_moe --part decode --decode-tokens 1 --decode-kinds fp8_channels --profile-decode"),
    f"{MOE_TARGETS}/decode_sweep_2.json": RunInfo(
        "python -m bench.bench_moe --part decode --decode-tokens 1 16 --decode-kinds fp8_channels fp8_blocks "
        "(whole-config sweep)"),
    f"{MOE_TARGETS}/grouped_gemm_flatten.json": RunInfo("python -m bench.bench_grouped_gemm --flatten"),
    f"{MOE_TARGETS}/grouped_gemm_sweep_flatten.json": RunInfo("python -m bench.bench_grouped_gemm --flatten --sweep"),
    f"{MOE_TARGETS}/grouped_gemm_flatten_balanced_3072.json": RunInfo(
        "python -m bench.bench_grouped_gemm --flatten --routing balanced --tokens 3072"),
    f"{MOE_TARGETS}/bench_layers_denoise.json": RunInfo("python -m bench.bench_layers --layer denoise --profile"),
    f"{MOE_TARGETS}/bench_layers_ar_decode.json": RunInfo("python -m bench.bench_layers --layer ar_decode --profile"),
    f"{MOE_TARGETS}/t2i_2layers_fp8_channels.json": RunInfo(
        f"{T2I_2LAYERS} --compile --max-new-tokens 64 --steps 6 --moe-dtype fp8"),
    f"{MOE_TARGETS}/t2i_2layers_fp8_tensor.json": RunInfo(
        f"{T2I_2LAYERS} --compile --max-new-tokens 64 --steps 6 --moe-dtype fp8 --fp8-scales tensor"),
    # CPU
    CPU_COMPILE: RunInfo("python -m bench.bench_compile --layers 2,16 --modes regions,whole", software=CPU_STACK),
    SERVE: RunInfo("python -m bench.bench_serve --requests 5 --steps 8", software=CPU_STACK),
    SERVE_LOAD: RunInfo("python -m bench.bench_serve --requests 100 --overhead-requests 0 --budget 4200",
                        software=CPU_STACK),
}

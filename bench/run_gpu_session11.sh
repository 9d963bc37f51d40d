#!/usr/bin/env bash
# Session 11's second GPU call (one H200), each step under a time limit; results in $OUT.
#   OUT=outputs/gpu11 bash bench/run_gpu_session11.sh
# 1. bench_memory: T2I and TI2I (32 layers, FP8 experts, compiled regions) with no lever, every
#    lever but the bf16 VAE, and every lever: per-phase peaks and the request's timings.
# 2. The CLI with FP8 dense linears too (and every memory lever): AR ms/token, DiT step, peak.
# 3. bench_batch: 4 same-bucket requests batched against one at a time (10 steps, 1 repeat).
# 4. bench_decode_batch's step part: 8 requests of 1-6k tokens against one.
set -u
OUT=${OUT:-outputs/gpu11}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; grep -v "it/s\]\|Warning" "$OUT/$name.log" | tail -n "${TAIL:-6}"; }
TAIL=14 step bench_memory 180 python3 -m bench.bench_memory --configs baseline,all_fp32_vae,all --runs t2i,ti2i \
    --out "$OUT/bench_memory.json"
TAIL=3 step t2i_dense_fp8 110 python3 -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --dense-dtype fp8 \
    --compile --prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 \
    --kv-caches release --vae-dtype bfloat16 --vae-chunks 4 --moe-token-chunk 2048 \
    --report "$OUT/t2i_dense_fp8.json" --output "$OUT/t2i_dense_fp8.png"
step bench_batch 150 python3 -m bench.bench_batch --steps 10 --repeats 1 --out "$OUT/bench_batch.json"
step decode_step 110 python3 -m bench.bench_decode_batch --parts step --repeats 5 --step-iters 10 \
    --out "$OUT/decode_step.json"
cat "$OUT/summary.txt"

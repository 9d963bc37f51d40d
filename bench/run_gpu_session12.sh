#!/usr/bin/env bash
# Session 12's GPU calls (one H200), each step under a time limit; results in $OUT.
#   OUT=outputs/gpu12 bash bench/run_gpu_session12.sh decode    # call 1
#   OUT=outputs/gpu12 bash bench/run_gpu_session12.sh serve     # call 2
# decode: 1. bench_decode, 32 layers, FP8 experts, regions: where an AR decode step's time goes,
#            the triton decode impl (the default) and sdpa, kernels by kind and launches per step.
#         2. the same with FP8 dense linears too (triton).
#         3. bench_batch with 256 AR tokens: 4 requests batched (their AR decoded together, their
#            denoise steps as rows of one batch) against one at a time.
# serve:  bench_serve's overhead part: the server against the CLI, one request at a time.
set -u
OUT=${OUT:-outputs/gpu12}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; grep -v "it/s\]\|Warning" "$OUT/$name.log" | tail -n "${TAIL:-6}"; }
case "${1:-decode}" in
decode)
  TAIL=30 step decode_fp8 170 python3 -m bench.bench_decode --layers 32 --moe-dtype fp8 --decode-impls triton,sdpa \
      --tokens 64 --kernels 40 --out "$OUT/decode_fp8.json"
  TAIL=12 step decode_dense_fp8 130 python3 -m bench.bench_decode --layers 32 --moe-dtype fp8 --dense-dtype fp8 \
      --decode-impls triton --tokens 64 --kernels 30 --out "$OUT/decode_dense_fp8.json"
  step bench_batch_ar 250 python3 -m bench.bench_batch --steps 10 --repeats 1 --max-new-tokens 256 \
      --out "$OUT/bench_batch_ar.json"
  ;;
serve)
  TAIL=12 step bench_serve 560 python3 -m bench.bench_serve --overhead-requests 5 --requests 0 --steps 10 \
      --max-new-tokens 256 --size 1024x1024 --timeout 400 --out "$OUT/bench_serve.json" \
      -- --random-weights full --moe-dtype fp8 --compile
  ;;
esac
cat "$OUT/summary.txt"

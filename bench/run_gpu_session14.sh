#!/usr/bin/env bash
# Session 14's GPU calls (one H200), each step under a time limit; results in $OUT (JSON,
# summary.txt, and the logs as logs.tgz).
#   OUT=outputs/gpu14 bash bench/run_gpu_session14.sh tests,micro,decode     # call 2
#   OUT=outputs/gpu14 bash bench/run_gpu_session14.sh peers,t2i              # call 3
# Carry [".golden", ".whl"]: .golden/ holds copies of ../shared/golden and ../shared/golden-taylor,
# .whl/ the wheels bench/gpu_wheels.sh fetches (diffusers, the server stack).
# tests:  every one-GPU test (`-m "gpu and not multigpu"`; TESTS="files" for some), with the golden
#         cases and diffusers where they were carried (.golden/golden, .golden/golden-taylor; .whl/).
# micro:  the decode step's new ops alone: the fused MoE router, the decode GEMV (bf16, FP8).
# decode: bench_decode, 32 layers, FP8 experts, regions: the dense linears in bf16, then FP8.
# peers:  Qwen-Image's MMDiT, dtgen vs diffusers, 1024x1024, bf16 (bench_qwen_peers).
# t2i:    the CLI's T2I on the released shapes (random weights, FP8 experts, 256 AR tokens,
#         10 steps) with the dense linears in bf16 and in FP8: the user's decode figure.
# Added in session 15:
# prologue: the fused attention prologue against the separate ops (bench_decode_batch --parts
#         prologue), PROLOGUE_ROWS="1,4,8,16,32" (and PROLOGUE_WARPS="4,8,16") sweep the rows a
#         program takes at prefill (and its warps).
# serve:  the server's overhead over the CLI, one request at a time, the released shapes
#         (bench_serve --overhead-requests ${SERVE_REQUESTS:-5}); first (session 16) the PNG
#         writer against Pillow's on this host's cores (bench_image_files).
# Added in session 16:
# vae:    the VAE's 4-frame convolutions run five ways in fp32 (TF32) and bf16
#         (bench/probes/vae_conv_probe.py), then bench_vae --suite (the whole 1024x1024 decode:
#         fast / plain ops, TF32 on / off, channels_last_3d, compiled; VAE_SUITE_ARGS=--no-compile;
#         NO_VAE_SUITE=1: the probe alone).
# Added in session 17:
# memory: bench_memory, T2I and TI2I at 32 layers with MEMORY_CONFIGS (default lean: every lever
#         but the MoE token chunks) and the dense linears in MEMORY_DENSE (default fp8).
# wanpeers: Wan's DiT against diffusers (bench_peers), WAN_MODES (regions) x WAN_VARIANTS.
# Added in session 18:
# ti2i:   the CLI's TI2I edit on the released shapes (random weights, FP8 experts and dense
#         linears, a random 1024x1024 reference, 256 AR tokens, 10 steps) with TI2I_ARGS
#         (e.g. "--profile /tmp/prof --profile-top 40": each phase's kernels, the condition's too).
# NO_VAE_PROBE=1: the vae stage without its probe (the suite alone).
# WAN_ARGS (session 20): more flags for the wanpeers stage (e.g. "--profile 12").
# DECODE_ARGS, DECODE_LIMIT (session 20): more flags for the decode stage's dense-FP8 run (e.g.
#         "--tokens 128") and its time limit.
# MEMORY_ARGS: more flags for bench_memory (e.g. "--repeats 2").
# T2I_ARGS: more flags for the t2i stage's runs (e.g. "--profile /tmp/prof --profile-top 40").
# PEERS_RUNS=N runs the peers stage N times (peers_1.json ...): a median over runs.
set -u
OUT=${OUT:-outputs/gpu14}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import diffusers" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d .golden/golden ] && export DTGEN_GOLDEN_DIRS=$PWD/.golden/golden
[ -d .golden/golden-taylor ] && export DTGEN_GOLDEN_TAYLOR_DIRS=$PWD/.golden/golden-taylor
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  grep -v "it/s\]\|Warning\|warn" "$OUT/$name.log" | tail -n "${TAIL:-6}"; }
T2I="python3 -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile --prompt-tokens 1251
  --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 ${T2I_ARGS:-}"
for stage in ${1//,/ }; do case "$stage" in
tests)
  TAIL=14 step gpu_tests "${TESTS_LIMIT:-330}" python3 -m pytest -q -m "gpu and not multigpu" -p no:cacheprovider \
      --durations=10 -rfs ${TESTS:-tests}
  ;;
micro)
  [ -z "${NO_ROUTER:-}" ] && TAIL=12 step bench_moe_router 60 python3 -m bench.bench_moe_router --out "$OUT/bench_moe_router.json"
  TAIL=24 step bench_decode_gemv "${GEMV_LIMIT:-90}" python3 -m bench.bench_decode_gemv ${GEMV_ARGS:-} --out "$OUT/bench_decode_gemv.json"
  ;;
decode)
  [[ ",${DECODE_KINDS:-bf16,fp8}," == *,bf16,* ]] && TAIL=14 step decode_bf16 100 python3 -m bench.bench_decode --layers 32 --moe-dtype fp8 --decode-impls triton \
      --tokens 64 --kernels 12 --out "$OUT/decode_bf16.json"
  [[ ",${DECODE_KINDS:-bf16,fp8}," == *,fp8,* ]] && TAIL=${DECODE_TAIL:-14} step decode_dense_fp8 "${DECODE_LIMIT:-100}" \
      python3 -m bench.bench_decode --layers 32 --moe-dtype fp8 --dense-dtype fp8 \
      --decode-impls triton --tokens 64 --kernels 12 ${DECODE_ARGS:-} --out "$OUT/decode_dense_fp8.json"
  ;;
peers)
  for run in $(seq 1 "${PEERS_RUNS:-1}"); do
    TAIL=16 step "qwen_peers_$run" "${PEERS_LIMIT:-240}" python3 -m bench.bench_qwen_peers --modes "${PEERS_MODES:-eager,compiled,regions}" \
        ${PEERS_ARGS:-} --out "$OUT/qwen_peers_$run.json"
  done
  ;;
prologue)
  TAIL=8 step prologue 120 python3 -m bench.bench_decode_batch --parts prologue \
      ${PROLOGUE_ROWS:+--prologue-rows "$PROLOGUE_ROWS"} ${PROLOGUE_WARPS:+--prologue-warps "$PROLOGUE_WARPS"} \
      --out "$OUT/prologue.json"
  ;;
serve)
  step bench_image_files 60 python3 -m bench.bench_image_files --out "$OUT/bench_image_files.json"
  TAIL=12 step bench_serve "${SERVE_LIMIT:-420}" python3 -m bench.bench_serve --overhead-requests "${SERVE_REQUESTS:-5}" \
      --requests 0 --steps 10 --max-new-tokens 256 --size 1024x1024 --timeout 300 --out "$OUT/bench_serve.json" \
      -- --random-weights full --moe-dtype fp8 --compile
  ;;
vae)
  [ -z "${NO_VAE_PROBE:-}" ] && step vae_conv_probe "${VAE_LIMIT:-150}" python3 -m bench.probes.vae_conv_probe --out "$OUT/vae_conv_probe.json"
  [ -z "${NO_VAE_SUITE:-}" ] && step bench_vae_suite "${VAE_LIMIT:-300}" python3 -m bench.bench_vae --suite ${VAE_SUITE_ARGS:-} \
      --out "$OUT/bench_vae_suite.json"
  ;;
t2i)
  [[ ",${T2I_KINDS:-bf16,fp8}," == *,bf16,* ]] && step t2i_bf16 "${T2I_LIMIT:-150}" $T2I --report "$OUT/t2i_bf16.json" --output /tmp/t2i_bf16.png
  [[ ",${T2I_KINDS:-bf16,fp8}," == *,fp8,* ]] && step t2i_dense_fp8 "${T2I_LIMIT:-150}" $T2I --dense-dtype fp8 --report "$OUT/t2i_dense_fp8.json" --output /tmp/t2i_dense_fp8.png
  ;;
memory)
  TAIL=16 step bench_memory "${MEMORY_LIMIT:-300}" python3 -m bench.bench_memory --configs "${MEMORY_CONFIGS:-lean}" \
      --dense-dtype "${MEMORY_DENSE:-fp8}" ${MEMORY_ARGS:-} --out "$OUT/bench_memory.json"
  ;;
ti2i)
  python3 -c "import numpy as np; from PIL import Image; Image.fromarray((np.random.RandomState(5).rand(1024, 1024, 3) * 255).astype('uint8')).save('/tmp/ti2i_ref.png')"
  step ti2i_dense_fp8 "${TI2I_LIMIT:-200}" python3 -m examples.hunyuan_t2i --random-weights full --moe-dtype fp8 --compile \
      --dense-dtype fp8 --image /tmp/ti2i_ref.png --max-new-tokens 256 --ignore-eos --steps 10 ${TI2I_ARGS:-} \
      --report "$OUT/ti2i_dense_fp8.json" --output /tmp/ti2i_dense_fp8.png
  ;;
wanpeers)
  TAIL=20 step wan_peers "${WAN_LIMIT:-300}" python3 -m bench.bench_peers --models "${WAN_MODELS:-1.3B,14B-8}" \
      --modes "${WAN_MODES:-regions}" --variants "${WAN_VARIANTS:-bf16,dense-fp8,attn-fp8,fp8}" ${WAN_ARGS:-} \
      --out "$OUT/wan_peers.json"
  ;;
*) echo "unknown stage $stage (tests, micro, decode, peers, t2i, prologue, serve, vae, memory, wanpeers, ti2i)"; exit 2 ;;
esac; done
# At most 8 files come back from a device call: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
cat "$OUT/summary.txt"

#!/usr/bin/env bash
# FP8 linears and FP8 attention on one GPU, then Wan against diffusers: one device call (~8 min).
#   bash bench/run_gpu_fp8_peers.sh
# 1. the GPU tests of tests/wan/test_fp8_attention.py and tests/hunyuan_image3/test_fp8_dense.py
#    (kernel at a Wan shape vs SDPA, rowwise _scaled_mm vs its reference, the tiny Wan compiled
#    with both options, the golden case with dense FP8 when outputs/golden is carried: see
#    bench/run_gpu_fp8.sh);
# 2. bench/bench_fp8_attention.py: FP8 attention vs SDPA bf16 (flash, cuDNN, efficient) at 32760 tokens;
# 3. bench/bench_peers.py: dtgen vs diffusers' WanTransformer3DModel, 1.3B at 30 blocks and the 14B
#    width at 8, 480p x 81 frames, eager and one region per block, bf16 and the FP8 options.
# diffusers is not on the GPU image: the wheels in .whl/ (carried) go to /tmp/site.
# Results land in $OUT (default outputs/gpu-fp8-peers): *.log, *.json, summary.txt.
set -u
OUT=${OUT:-outputs/gpu-fp8-peers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import diffusers" 2>/dev/null; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, torch.cuda.get_device_name())"
[ -d outputs/golden ] && export DTGEN_GOLDEN_DIRS=$PWD/outputs/golden

step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; tail -n "${TAIL:-8}" "$OUT/$name.log"; }

TAIL=14 step gpu_tests 130 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
    tests/wan/test_fp8_attention.py tests/hunyuan_image3/test_fp8_dense.py
TAIL=20 step bench_fp8_attention 70 python3 -m bench.bench_fp8_attention --out "$OUT/bench_fp8_attention.json"
TAIL=24 step bench_peers 280 python3 -m bench.bench_peers --models 1.3B,14B-8 --modes eager,regions \
    --variants bf16,dense-fp8,attn-fp8,fp8 --out "$OUT/bench_peers.json"
cat "$OUT/summary.txt"

#!/usr/bin/env bash
# The MoE kernels and FP8 experts on one GPU, in calls that fit the device's 10-minute limit:
#   bash bench/run_gpu_fp8.sh tests   # GPU tests: MoE kernels (bf16, FP8), FP8 model on the golden case, CUDA-graph decode
#   bash bench/run_gpu_fp8.sh bench   # bench_layers (bf16 and FP8 layers), bench_moe, bench_grouped_gemm
#   bash bench/run_gpu_fp8.sh e2e     # full width, 2 layers, compiled: bf16 experts against FP8 (channels, tensor)
# Results land in $OUT (default outputs/gpu-fp8); a summary table prints last.
set -u
MODE=${1:-tests}
OUT=${OUT:-outputs/gpu-fp8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; tail -n 8 "$OUT/$name.log"; }

e2e() {  # name, then extra arguments: the seed's T2I shapes at 2 layers, compiled
  step "$1" 280 python3 -m examples.hunyuan_t2i --random-weights full --layers 2 --plan single --compile \
      --prompt-tokens 1251 --max-new-tokens 64 --ignore-eos --image-size 1024x1024 --steps 6 \
      --report "$OUT/$1.json" --output "$OUT/$1.png" "${@:2}"
}

case "$MODE" in
  tests)  # the golden FP8 tests need the golden cases: ../shared does not travel to the device, so
    # copy it to outputs/golden here and name outputs/golden in the device call's carry
    [ -d outputs/golden ] && export DTGEN_GOLDEN_DIRS=$PWD/outputs/golden
    step gpu_tests 540 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not traceable_fast_path_compiled" \
        tests/hunyuan_image3/test_moe_kernels.py tests/framework/test_moe_grouped_gemm.py \
        tests/hunyuan_image3/test_fp8_experts.py tests/hunyuan_image3/test_compile.py ;;
  bench)
    step bench_layers 240 python3 -m bench.bench_layers --out "$OUT/bench_layers.json"
    step bench_moe 200 python3 -m bench.bench_moe --out "$OUT/bench_moe.json"
    step bench_grouped_gemm 120 python3 -m bench.bench_grouped_gemm --out "$OUT/bench_grouped_gemm.json" ;;
  e2e)
    e2e t2i_2layers_bf16
    e2e t2i_2layers_fp8_channels --moe-dtype fp8
    e2e t2i_2layers_fp8_tensor --moe-dtype fp8 --fp8-scales tensor ;;
  *) echo "unknown mode $MODE (tests | bench | e2e)"; exit 2 ;;
esac
cat "$OUT/summary.txt"

#!/usr/bin/env bash
# Everything dtgen runs on a GPU machine, in priority order, each step under a time limit.
# Results land in $OUT (default outputs/gpu). Reproduce with: bash bench/run_gpu.sh
set -u
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; tail -n 12 "$OUT/$name.log"; }

# 1. GPU-marked tests: kernels at HunyuanImage-3 shapes (bf16), opcheck on CUDA, CUDA-graph decode.
step gpu_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/hunyuan_image3/test_moe_kernels.py \
    tests/framework/test_attention_kernels.py tests/framework/test_attention_segments.py \
    tests/hunyuan_image3/test_compile.py
# 2. Layer benchmarks (eager / compiled / CUDA graph / GEMM-autotuned against the floors),
#    the AR decode step end to end, and the grouped GEMMs alone.
step bench_layers 300 python3 -m bench.bench_layers --profile --out "$OUT/bench_layers.json"
step bench_decode 120 python3 -m bench.bench_decode --out "$OUT/bench_decode.json"
step bench_grouped_gemm 200 python3 -m bench.bench_grouped_gemm --autotune --out "$OUT/bench_grouped_gemm.json"
# 3. Attention kernels (pack/unpack, LSE merge) bandwidth.
step bench_attention 60 python3 -m bench.bench_attention --out "$OUT/bench_attention.json"
# 4. Issue 7 at reduced depth: full width, 2 layers, one GPU, the seed's T2I shapes.
step t2i_full_2layers 200 python3 -m examples.hunyuan_t2i --random-weights full --layers 2 --plan single \
    --prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 \
    --report "$OUT/t2i_full_2layers.json" --output "$OUT/t2i_full_2layers.png"
# 4b. The same, compiled (one graph per phase and shape; CUDA-graph decode).
step t2i_full_2layers_compiled 240 python3 -m examples.hunyuan_t2i --random-weights full --layers 2 --plan single \
    --prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 --compile \
    --report "$OUT/t2i_full_2layers_compiled.json" --output "$OUT/t2i_full_2layers_compiled.png"
# 4c. The same with the GEMMs tuned by inductor (the MoE's grouped GEMMs traced).
step t2i_full_2layers_autotune 400 python3 -m examples.hunyuan_t2i --random-weights full --layers 2 --plan single \
    --prompt-tokens 1251 --max-new-tokens 256 --ignore-eos --image-size 1024x1024 --steps 10 --compile \
    --compile-autotune --report "$OUT/t2i_full_2layers_autotune.json" --output "$OUT/t2i_full_2layers_autotune.png"
# 5. With two GPUs: the tiny model through torchrun + NCCL on the 2-rank plan, checked.
if [ "$NGPU" -ge 2 ]; then
  step torchrun_hybrid2 120 torchrun --nproc-per-node 2 -m examples.hunyuan_t2i --world-size 2 --plan hybrid2 \
      --steps 4 --max-new-tokens 4 --check --dtype float32 --report "$OUT/torchrun_hybrid2.json" \
      --output "$OUT/torchrun_hybrid2.png"
fi
cat "$OUT/summary.txt"

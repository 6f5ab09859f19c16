#!/usr/bin/env bash
# Build the Slipway squashfs image for container=pyxis with pyxis itself: the NGC PyTorch release and the
# install steps of slipway-ngc.def (read from it, so both images stay the same), saved with --container-save.
#   containers/build_sqsh.sh [OUTPUT.sqsh] [srun options...]     (default: containers/slipway-ngc.sqsh)
# e.g. containers/build_sqsh.sh /shared/images/slipway-ngc.sqsh -p <partition> -c 16 --mem=64G -t 60
# Run it where srun has pyxis (the build compiles CUDA kernels on the node it gets).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-containers/slipway-ngc.sqsh}")"
shift || true
def=containers/slipway-ngc.def
from="$(sed -n 's/^From:[[:space:]]*//p' "$def")"            # nvcr.io/nvidia/pytorch:YY.MM-py3
image="${from/\//#}"                                         # enroot's form: REGISTRY#IMAGE:TAG
post="$(awk '/^%post/ {on = 1; next} /^%/ {on = 0} on' "$def")"  # the install steps
check="$(awk '/^%test/ {on = 1; next} /^%/ {on = 0} on' "$def")" # the image's self-test
[ -n "$from" ] && [ -n "$post" ] && [ -n "$check" ] || { echo "cannot read From/%post/%test of $def" >&2; exit 1; }
grep -q -- --container-save <<<"$(srun --help 2>&1)" || { echo "srun has no pyxis (--container-save)" >&2; exit 1; }
# %files copies the repository to /opt/slipway; here a read-only mount of it is copied there. Root inside
# the container (remapped, no privileges on the host) lets pip install into the image's Python.
srun --ntasks=1 "$@" --container-image="$image" --container-mounts="$PWD:/src:ro" --container-remap-root \
  --container-writable --no-container-mount-home --container-save="$out" \
  bash -c "mkdir -p /opt/slipway && cp -a /src/. /opt/slipway && $post"
srun --ntasks=1 "$@" --container-image="$out" --no-container-mount-home bash -c "$check"
echo "built $out; use it with: python launch.py +experiment=codeparrot container=pyxis container.image=$out"

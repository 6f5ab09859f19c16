"""Run every CPU benchmark in sequence (`make bench`); each prints its own ratios and writes bench/results/.

GPU figures come from bench/gpu_check.sh on a GPU machine. A failing benchmark does not stop the others;
the exit status is non-zero when any failed, and the closing table names them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Ordered cheapest first, so a user who interrupts still gets the quick figures.
BENCHES = [
    ["index_build.py"],
    ["fused_ops.py", "--device", "cpu"],
    ["preprocess.py"],
    ["pipeline.py"],
    ["health.py"],
    ["kernel_check.py"],
    ["recompute.py"],
    ["convert.py"],
    ["megatron_lm.py"],  # Megatron-LM's git directory: $MEGATRON_LM_REPO or the mirror; NOT RUN without
    ["eval.py"],
    ["train.py"],
]


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    results = []
    for argv in BENCHES:
        sys.stdout.write(f"\n=== bench/{' '.join(argv)}\n")
        sys.stdout.flush()
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / argv[0]), *argv[1:]], cwd=HERE.parent)
        results.append((argv[0], rc, time.perf_counter() - start))
    sys.stdout.write("\nbenchmark          status   seconds\n")
    for name, rc, secs in results:
        sys.stdout.write(f"{name:<18} {'ok' if rc == 0 else f'rc={rc}':<8} {secs:7.1f}\n")
    return 1 if any(rc for _, rc, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Add a GPU run's measurements to the committed MFU figures (bench/results/mfu.json, read by
trainer.measured for the plan's ETA): one row per A/B row of bench/ab_step.py and per bench/loop_gpu.py
run found in ``--results``, each with the device, the model's shape, the settings, the date and commit of
the run and the file holding the raw output (``--source``, the gpu_check log).

    python bench/record_mfu.py --results bench/results --source bench/results/gpu_check_<UTC>.txt

``--log`` reads a gpu_check log instead: the points of bench/train_gpu.py's search for the best micro-batch
("best micro-batch by csrc's tokens/s:", one line per size) become rows of their own (trainer.measured.SWEEP:
how the MFU grows with the micro-batch, the curve the plan's estimate fits), dated and attributed by the log
(its file name's UTC date, its ``commit`` line):

    python bench/record_mfu.py --log bench/results/gpu_check_20261204T131708Z.txt

Rows of the same device, model, measurement, settings and commit are replaced (a rerun); others are kept
(the reader takes the newest). Rows without an MFU (CPU rehearsals) are not recorded.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.gpt_step import model_section  # noqa: E402
from trainer.measured import FORMAT, LOOP, MFU_FILE, STEP, SWEEP  # noqa: E402

KEY = ("device", "model", "what", "micro_batch", "precision", "recipe", "kernels", "attention", "commit")


def _shape(model: str) -> dict:
    m = model_section(model, 0)
    return {"num_layers": m["num_layers"], "hidden_size": m["hidden_size"], "seq_length": m["seq_length"]}


def _attention(backend: str, dropout) -> str:
    return f"sdpa {backend}, dropout {'model default' if dropout is None else dropout}"


def ab_rows(doc: dict, source: str) -> list[dict]:
    out = []
    for name, r in doc["rows"].items():
        spec = r["spec"]
        if r.get("mfu") is None:
            continue
        out.append({"device": doc["device"], "model": doc["model"], **_shape(doc["model"]), "what": STEP,
                    "micro_batch": r["micro_batch"], "precision": spec["precision"], "recipe": spec["recipe"],
                    "kernels": spec["kernels"], "attention": _attention(spec["sdpa_backend"],
                                                                        spec["attention_dropout"]),
                    "tokens_per_s": round(r["tokens_s"]), "mfu": round(r["mfu"], 4),
                    "peak_mem_gib": r["peak_mem_gib"] and round(r["peak_mem_gib"], 1),
                    "date": doc["date"][:10], "commit": doc["commit"], "source": source,
                    "notes": f"bench/ab_step.py row {name}"
                    + (", host sync every step" if r.get("sync_every_step") else "")})
    return out


def loop_rows(doc: dict, source: str) -> list[dict]:
    rows = doc["rows"]
    if not rows or "perf/mfu" not in rows[-1]:
        return []
    a, r = doc["args"], rows[-1]
    return [{"device": doc.get("device", "unknown"), "model": doc["model"], **_shape(doc["model"]),
             "what": LOOP, "micro_batch": a["micro_batch"], "precision": a["precision"],
             "recipe": a["recipe"], "kernels": a["kernels"],
             "attention": _attention(a["sdpa_backend"], a["attention_dropout"]),
             "tokens_per_s": round(r["perf/tokens_per_s"]), "mfu": round(r["perf/mfu"], 4),
             "peak_mem_gib": round(r["perf/peak_mem_gb"] * 1e9 / 2**30, 1), "date": doc["date"][:10],
             "commit": doc["commit"], "source": source,
             "notes": f"python -m trainer.run, {a['accumulate']} micro-batch(es) per step, iteration "
                      f"{r['iteration']}"}]


# bench/train_gpu.py's lines: the device and shape, the probe's kernels, one line per micro-batch.
_HEAD = re.compile(r"^(?P<device>\S.*?)  torch \S+  model (?P<model>\w+) \(.*?\) seq \d+ (?P<precision>\w+)  "
                   r"peak (?P<peak>[\d.]+) TFLOP/s$", re.M)
_PROBE = re.compile(r"^best micro-batch by (?P<kernels>\w+)'s tokens/s:$", re.M)
_POINT = re.compile(r"^  micro-batch +(?P<mb>\d+): +(?P<tokens>\d+) tokens/s +(?P<tflops>[\d.]+) TFLOP/s +"
                    r"peak (?P<mem>[\d.]+) GiB$")


def sweep_rows(text: str, source: str) -> list[dict]:
    """The micro-batch sweep of a gpu_check log ``text`` (committed as ``source``, whose name holds the UTC
    date: gpu_check_<YYYYMMDD>T...): one row per size that ran, its MFU the TFLOP/s over the peak the line
    above states; [] without a sweep or a peak (a CPU rehearsal prints "peak -")."""
    head, probe = _HEAD.search(text), _PROBE.search(text)
    date = re.search(r"gpu_check_(\d{4})(\d{2})(\d{2})T", source)
    commit = re.search(r"^commit (\w+)", text, re.M)
    if not (head and probe and date and commit) or probe.start() < head.start():
        return []
    m = model_section(head["model"], 0)
    out = []
    for line in text[probe.end():].splitlines()[1:]:
        point = _POINT.match(line)
        if point is None:
            if line.startswith("  micro-batch"):
                continue  # a size that ran out of memory
            break
        out.append({"device": head["device"], "model": head["model"], **_shape(head["model"]), "what": SWEEP,
                    "micro_batch": int(point["mb"]), "precision": head["precision"], "recipe": "autocast",
                    "kernels": probe["kernels"],
                    "attention": f"sdpa (torch default), dropout {m['attention_dropout']}",
                    "tokens_per_s": int(point["tokens"]),
                    "mfu": round(float(point["tflops"]) / float(head["peak"]), 4),
                    "peak_mem_gib": float(point["mem"]), "date": "-".join(date.groups()), "commit": commit[1],
                    "source": source,
                    "notes": "bench/train_gpu.py's search for the best micro-batch: the step alone (model + "
                             "optimizer, one micro-batch per step), a few steps at each size"})
    return out


def merge(path: str, new: list[dict]) -> int:
    doc = {"format": FORMAT, "rows": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    keys = {tuple(r.get(k) for k in KEY) for r in new}
    doc["rows"] = [r for r in doc["rows"] if tuple(r.get(k) for k in KEY) not in keys] + new
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return len(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="folder holding ab_*.json and loop_*.json of this run")
    ap.add_argument("--source", help="the committed file with the run's raw output (with --log: the log)")
    ap.add_argument("--log", help="a gpu_check log: record its micro-batch sweep (bench/train_gpu.py)")
    ap.add_argument("--mfu-file", default=str(MFU_FILE))
    ap.add_argument("--device", default=None, help="the device name for loop rows (default: torch's)")
    a = ap.parse_args(argv)
    if a.log:
        with open(a.log, encoding="utf-8") as f:
            new = sweep_rows(f.read(), a.source or os.path.relpath(a.log, REPO))
        return _report(a.mfu_file, new) if new else _fail(f"{a.log}: no micro-batch sweep with a peak in it")
    if not (a.results and a.source):
        return _fail("give --results and --source (a GPU run's result files), or --log (a gpu_check log)")
    device = a.device
    if device is None:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    new = []
    for path in sorted(glob.glob(os.path.join(a.results, "ab_*.json"))):
        with open(path, encoding="utf-8") as f:
            new += ab_rows(json.load(f), a.source)
    for path in sorted(glob.glob(os.path.join(a.results, "loop_*.json"))):
        with open(path, encoding="utf-8") as f:
            new += loop_rows({"device": device, **json.load(f)}, a.source)
    return _report(a.mfu_file, new)


def _report(mfu_file: str, new: list[dict]) -> int:
    print(f"record_mfu: {merge(mfu_file, new)} row(s) into {mfu_file}")
    for r in new:
        print(f"  {r['device']} {r['model']} {r['what']} mb{r['micro_batch']} {r['recipe']} {r['kernels']} "
              f"{r['attention']}: {100 * r['mfu']:.1f}%")
    return 0


def _fail(message: str) -> int:
    print(f"record_mfu: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Goodput on the devcluster (issue 53): the same run trained twice in this one run of the bench, with
synchronous and with asynchronous checkpoints, failures injected through the fault seam.

Each run is a real launch (``launch.py +experiment=codeparrot_smoke cluster=devcluster``): a GPT of
≥ 300M parameters (24 layers × 1024, fp32 on the CPU, tp=2 over the devcluster's two nodes: its 8 GB per
node hold one rank's half of the state and its host copy), a save every ``save`` iterations, ranks
SIGKILLed after the ``crashes`` iterations (``SLIPWAY_CRASH_TRAIN``: the job script retries the step in
its allocation) and one ``scancel --signal=USR2 --batch`` at ``requeue_at`` (the ranks pause there,
``SLIPWAY_STALL_TRAIN``, until it comes: the bench reacts within half a second; then save, exit 75,
requeue: a new allocation). The figures come from the runs' own goodput records (trainer/goodput) and
checkpoints, and this disk's sequential speed is measured in the same run with ``dd`` (``conv=fdatasync``
for writes, ``iflag=direct`` for reads):

- training blocked per save, asynchronous vs synchronous (goal: ≤ 10 %);
- save throughput (the checkpoint's bytes on disk / the time from the save's start to its commit) and
  load throughput (its bytes / the checkpoint_load phase) against dd's (goal: writes ≥ 70 %);
- time to the first step of every attempt, by phase; goodput and the time lost by cause;
- bit-identical resume: both runs' per-iteration losses (replays included: each resumed from its own
  checkpoints) and their final checkpoints' tensors must be equal;
- start-up's checkpoint phases before and after the checksums moved beside the load, read cold.

    python bench/goodput.py            # the bench: results/goodput.json (tens of minutes; ~12 GB of RAM)
    python bench/goodput.py --tiny     # the same code on a tiny model (tests/bench/test_goodput_bench.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import ROOT, load, run_meta  # noqa: E402
from trainer.run_files import RunDir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "goodput.json"


@dataclass(frozen=True)
class Spec:
    """One size of the bench."""

    layers: int
    hidden: int
    heads: int
    seq: int
    iters: int
    save: int
    crashes: tuple[int, ...]
    requeue_at: int | None
    tp: int
    mem_gb: int  # per node
    need_gib: float  # free memory to start with
    dd_mib: int  # dd's file size

    def overrides(self) -> list[str]:
        return [f"model.num_layers={self.layers}", f"model.hidden_size={self.hidden}",
                f"model.num_attention_heads={self.heads}", f"model.seq_length={self.seq}",
                f"model.max_position_embeddings={self.seq}", "model.hidden_dropout=0.0",
                "model.attention_dropout=0.0", f"train.iters={self.iters}",
                f"train.save_interval={self.save}",
                "train.micro_batch_size=1", "train.global_batch_size=1", "train.log_interval=1",
                "train.eval_interval=null", "train.deterministic=true", "train.hang_timeout_s=1800",
                "optim.warmup_iters=2", f"parallel.tp_size={self.tp}", "parallel.pp_size=1",
                f"cluster.nodes={self.tp}", "cluster.tasks_per_node=1", "cluster.cpus_per_task=2",
                f"cluster.mem_gb={self.mem_gb}", "cluster.max_retries=4", "cluster.time_limit_min=120",
                "+cluster.env.OMP_NUM_THREADS=1", "checkpoint.keep=2", "kernels=eager",
                "convert.enabled=false", "logging.wandb.mode=disabled", "data.workers=1",
                "cluster.stage_cpus=1", "wait=false",
                f"+cluster.env.SLIPWAY_CRASH_TRAIN='{','.join(map(str, self.crashes))}'",  # a string to Hydra
                *([f"+cluster.env.SLIPWAY_STALL_TRAIN={self.requeue_at}"] if self.requeue_at else [])]


BIG = Spec(layers=24, hidden=1024, heads=16, seq=128, iters=50, save=12, crashes=(18, 42), requeue_at=30,
           tp=2, mem_gb=8, need_gib=13.0, dd_mib=2048)
TINY = Spec(layers=2, hidden=64, heads=4, seq=32, iters=12, save=4, crashes=(7,), requeue_at=10, tp=1,
            mem_gb=2, need_gib=2.0, dd_mib=64)


def available_gib() -> float:
    """MemAvailable (what `free -g` calls available)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


def _dd(args: list[str]) -> float:
    """MB/s (10^6 bytes) dd reports for one transfer."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", out)
    return int(m.group(1)) / float(m.group(2)) / 1e6


def disk_speed(folder: Path, mib: int, repeats: int = 2) -> dict:
    """This filesystem's sequential write (fdatasync before dd ends) and read (O_DIRECT: not the page
    cache) in MB/s, the median of ``repeats``."""
    path = folder / ".dd-bench"
    writes, reads = [], []
    try:
        for _ in range(repeats):
            writes.append(_dd(["if=/dev/zero", f"of={path}", "bs=16M", f"count={mib // 16}",
                               "conv=fdatasync"]))
            reads.append(_dd([f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"]))
    finally:
        path.unlink(missing_ok=True)
    return {"write_MBps": statistics.median(writes), "read_MBps": statistics.median(reads),
            "writes": writes, "reads": reads, "file_MiB": mib}


def launch_run(spec: Spec, mode: str, root: Path, run_id: str) -> Path:
    from tests.seam import hook_env

    cmd = [sys.executable, "launch.py", "+experiment=codeparrot_smoke", "cluster=devcluster",
           f"runs_root={root}", f"run_id={run_id}", f"checkpoint.async_save={mode == 'async'}",
           *spec.overrides()]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **hook_env()}, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"launch of {run_id} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    return root / "codeparrot_smoke" / run_id


def drive(run_dir: Path, spec: Spec) -> dict:
    """Wait for the run's end, preempting it once: at ``requeue_at`` every rank pauses
    (``SLIPWAY_STALL_TRAIN``, until a signal comes) and this sends USR2 to the batch shell, which forwards
    it to the step: the ranks stop there, save, exit 75 and the job is requeued."""
    from orchestrator.world.queue import ended
    from tests.orchestrator.devcluster_helpers import job_ids, states
    from tests.slurm_cli import slurm
    from tests.waits import wait_until
    from trainer.run_files import RunDir

    sent = None
    stalled = RunDir(run_dir).stage_state("train") / f"stalled_{spec.requeue_at}_rank0"

    def done() -> bool:
        nonlocal sent
        if sent is None and spec.requeue_at is not None and stalled.exists():
            job = job_ids(run_dir)["train"]
            slurm("scancel", "--signal=USR2", "--batch", job)
            sent = {"job": job, "iteration": spec.requeue_at, "time": time.time()}
        now = states(run_dir)
        return bool(now) and all(ended(s) for s in now.values())

    wait_until(done, f"the run {run_dir.name} to end", 4 * 3600, poll_s=0.5)
    return {"states": states(run_dir), "usr2": sent}


def figures(run_dir: Path, disk: dict) -> dict:
    """What the run's records and checkpoints say (see the module doc)."""
    from trainer.checkpoint.files import read_tracker
    from trainer.disk import folder_bytes
    from trainer.goodput import account, format_lines, read_records

    recs = read_records(str(run_dir))
    g = account(recs)
    ckpts = RunDir(run_dir).checkpoints
    # Every checkpoint of a run has the same size (the same tensors; earlier ones are pruned): the last's,
    # both ranks' files, manifest and digests included.
    size = folder_bytes(str(ckpts / f"iter_{read_tracker(str(ckpts)):07d}"))
    saves = []
    for r in recs:
        for s in r.get("saves", []):
            mbps = size / s["write_s"] / 1e6 if s.get("write_s") else None
            saves.append({**s, "checkpoint_bytes": size, "write_MBps": mbps,
                          "write_vs_dd": mbps / disk["write_MBps"] if mbps else None})
    loads = [{**r["load"], "MBps": r["load"]["bytes"] / r["load"]["seconds"] / 1e6,
              "vs_dd_read": r["load"]["bytes"] / r["load"]["seconds"] / 1e6 / disk["read_MBps"]}
             for r in recs if r.get("load") and r["load"]["seconds"] > 0]
    attempts = [{"job": r["job"], "restart": r["restart"], "attempt": r["attempt"],
                 "start_iteration": r["start_iteration"], "iteration": r["iteration"], "ended": r["ended"],
                 "to_first_step_s": (r["first_step_end"] - r["process_start"]) if r.get("first_step_end")
                 else None, "startup": {k: v for k, v in r["seconds"].items() if k in _STARTUP and v >= 0.01}}
                for r in recs]
    return {"goodput": g.fraction, "allocated_s": g.allocated_s, "productive_s": g.productive_s,
            "lost_s": g.lost, "waiting_s": g.waiting_s, "startup_s": g.startup, "lines": format_lines(g),
            "saves": saves, "loads": loads, "attempts": attempts}


_STARTUP = ("imports", "setup", "rendezvous", "preflight", "checkpoint_select", "build", "kernel_check",
            "checkpoint_load", "data", "wandb", "first_step")


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def same_training(a: Path, b: Path, iters: int, tp: int) -> dict:
    """Both runs' losses per iteration, and their final checkpoints' tensors (model, optimizer), equal."""
    import torch

    from trainer.checkpoint import protocol as ckpt
    from trainer.metrics_file import TRAIN_LOSS, series

    la, lb = dict(series(a, TRAIN_LOSS)), dict(series(b, TRAIN_LOSS))
    differ = []
    for t in range(tp):
        sa = ckpt.load_file(ckpt.shard_path(str(RunDir(a).checkpoints), iters, t, 0, 1), mmap=True)
        sb = ckpt.load_file(ckpt.shard_path(str(RunDir(b).checkpoints), iters, t, 0, 1), mmap=True)
        for key in ("model", "optimizer", "opt_param_scheduler", "rng_state"):
            flat_a, flat_b = flat_tensors(sa[key]), flat_tensors(sb[key])
            if flat_a.keys() != flat_b.keys() or any(not torch.equal(flat_a[k], flat_b[k]) for k in flat_a):
                differ.append(f"rank {t} {key}")
    return {"losses_equal": la == lb and len(la) == iters, "iterations_compared": len(la),
            "final_checkpoint_tensors_equal": not differ, "differ": differ}


def flat_tensors(obj, prefix: str = "") -> dict:
    """Every tensor in a nested state (dicts, lists), by its path: two states compare key by key."""
    import torch

    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat_tensors(val, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flat_tensors(val, f"{prefix}/{i}").items()}
    return {}


def _evict(folder: Path) -> None:
    """Drop a checkpoint's pages from the page cache (a restart on another node reads them from disk)."""
    for f in (p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def verify_then_load(run_dir: Path, tp: int, repeats: int = 2) -> dict:
    """Start-up's checkpoint phases before and after issue 53, on the run's last checkpoint read cold:
    before, the choice hashed every file (checkpoint.select_latest(full=True)) and then the ranks loaded
    them; now the choice checks sizes and the hash runs beside the load (trainer.run.choice.LoadCheck).
    The ranks' shards are loaded one after the other here (one process); seconds, best of ``repeats``."""
    from trainer.checkpoint import protocol as ckpt
    from trainer.run.choice import LoadCheck

    ckpts = RunDir(run_dir).checkpoints
    it = ckpt.read_tracker(str(ckpts))

    def load_all() -> None:
        for t in range(tp):
            ckpt.load_file(ckpt.shard_path(str(ckpts), it, t, 0, 1))

    def before() -> None:
        assert ckpt.select_latest(str(ckpts), act=False, full=True).iteration == it
        load_all()

    def after() -> None:
        assert ckpt.select_latest(str(ckpts), act=False, full=False).iteration == it
        check = LoadCheck(str(ckpts), it, act=False)
        load_all()
        assert check.confirm()

    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(repeats):
        for name, fn in (("before", before), ("after", after)):
            _evict(ckpts / f"iter_{it:07d}")
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    return {"iteration": it, "bytes": _bytes(ckpts / f"iter_{it:07d}"), "seconds": times, "best": best,
            "after_over_before": best["after"] / best["before"]}


def _bytes(folder: Path) -> int:
    from trainer.disk import folder_bytes

    return folder_bytes(str(folder))


def summary(result: dict) -> dict:
    """The goals' ratios from both modes' figures."""
    s, a, disk = result["sync"], result["async"], result["disk"]
    sync_blocked = _mean([x["blocked_s"] for x in s["saves"] if x["mode"] == "sync"])
    periodic = [x for x in a["saves"] if x["blocked_s"] is not None and x["write_s"] is not None
                and x["blocked_s"] < x["write_s"]]  # the ones training did not wait for (not the stop's)
    async_blocked = _mean([x["blocked_s"] for x in periodic])
    async_write = _mean([x["write_MBps"] for x in a["saves"]])
    return {"blocked_sync_s": sync_blocked, "blocked_async_s": async_blocked,
            "blocked_ratio": async_blocked / sync_blocked if async_blocked and sync_blocked else None,
            "write_MBps_sync": _mean([x["write_MBps"] for x in s["saves"]]), "write_MBps_async": async_write,
            "write_vs_dd_async": async_write / disk["write_MBps"] if async_write else None,
            "load_vs_dd": _mean([x["vs_dd_read"] for x in a["loads"] + s["loads"]]),
            "goodput_sync": s["goodput"], "goodput_async": a["goodput"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny model (the bench's own test)")
    p.add_argument("--root", default=None, help="runs_root of the bench's runs (default: runs/ of this "
                   "checkout, which every devcluster node sees; /tmp is each node's own)")
    p.add_argument("--results", default=None, help=f"where the JSON goes (default {RESULTS}; --tiny: none)")
    p.add_argument("--keep", action="store_true", help="keep the runs' checkpoints (default: removed)")
    args = p.parse_args(argv)
    spec = TINY if args.tiny else BIG
    root = Path(args.root or Path(__file__).resolve().parents[1] / "runs" / f"goodput-bench-{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    free = available_gib()
    if free < spec.need_gib:
        print(f"goodput bench: {free:.1f} GiB of memory available, {spec.need_gib} needed: not started "
              "(other work is using the machine; try again later)", file=sys.stderr)
        return 3
    result = {"meta": {**run_meta(), "available_gib": round(free, 1)}, "spec": asdict(spec),
              "disk": disk_speed(root, spec.dd_mib)}
    stamp = time.strftime("%H%M%S")
    for mode in ("sync", "async"):
        run_dir = launch_run(spec, mode, root, f"goodput-{mode}-{stamp}")
        result[f"{mode}_run"] = {"dir": str(run_dir), **drive(run_dir, spec)}
        result[mode] = figures(run_dir, result["disk"])
        print(f"{mode}: " + "\n  ".join(result[mode]["lines"]), flush=True)
    runs = [Path(result[f"{m}_run"]["dir"]) for m in ("sync", "async")]
    result["same_training"] = same_training(*runs, spec.iters, spec.tp)
    result["verify_then_load"] = verify_then_load(runs[1], spec.tp)
    result["summary"] = summary(result)
    result["meta"]["load_after"] = load()
    out = Path(args.results) if args.results else (None if args.tiny else RESULTS)
    text = json.dumps(result, indent=1, default=str)
    if out is not None:
        out.write_text(text + "\n")
    print(json.dumps(result["summary"], indent=1))
    if not args.keep:
        for run in runs:
            subprocess.run(["rm", "-rf", str(RunDir(run).checkpoints)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

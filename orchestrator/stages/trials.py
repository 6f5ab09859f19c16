"""layout=auto's trials: the trainer for a few dozen iterations at one candidate layout, on the run's own
preprocessed data, measured from its metrics file, no checkpoint kept.

A trial is a short training run in its own directory (``<run_dir>/tune/trial_<i>/``, a run directory of
its own: metrics, heartbeats, logs). It runs ``warmup_iters`` iterations, then ``iters`` measured ones in
intervals of ``log_interval`` (the trainer's own log lines: tokens/s, TFLOP/s, MFU, peak memory), and ends
at the first step after the last measured interval, before the trainer's end-of-run checkpoint: the
measurement is complete and a checkpoint would be thrown away. Every rank that fails records why
(``trial_rank<r>.json``: out of memory, the trainer's verdict, a hang its watchdog caught); rank 0 records
the measurement. A record names the job that wrote it, so a later tuning never reads an earlier one's.

Where the ranks run: on Slurm every task of one job-array element runs its rank in-process
(:func:`run_rank`, from orchestrator/stages/tune.py); on the local executor one job runs the trials one
after another, each as ``world`` processes running :func:`main` (``SPEC JOB``: the trial's spec file
and the job; :func:`run_local`), and ends the others when one fails (as ``srun --kill-on-bad-exit``
does) or the trial's time is up. Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.world.runs import write_json
from trainer import faults
from trainer.health import node_name, read_hangs
from trainer.log import get_logger
from trainer.metrics_file import read_metrics
from trainer.run_files import TRIAL_RECORD, RunDir
from trainer.signals import EXIT_HANG, out_of_memory

if TYPE_CHECKING:
    from orchestrator.base.schema import AutotuneConfig

log = get_logger(__name__)

MEASURED, FAILED = "measured", "failed"
STEP_MS = "perf/ms_per_iter"  # the trainer's metric names (trainer/run/metrics.py interval_metrics)
_PERF = {"tflops_per_gpu": "perf/tflops_per_gpu", "mfu": "perf/mfu"}
_PEAK_MEM = "perf/peak_mem_gb"


@dataclass(frozen=True)
class TrialSpec:
    """One trial: which candidate (its index in the plan's ranking), its trainer config, what it measures."""

    run: str  # the run's directory (the trial's own is RunDir(run).trial(index))
    index: int
    name: str
    overrides: dict[str, dict[str, Any]]
    trainer_config: dict[str, Any]
    warmup_iters: int
    last_iter: int  # the last measured iteration (warmup + measured)
    key: str  # the tuning's key (orchestrator/stages/tune.py)

    @property
    def run_dir(self) -> Path:
        """The trial's own run directory."""
        return RunDir(self.run).trial(self.index)

    @property
    def spec_path(self) -> Path:
        return RunDir(self.run).trial_spec(self.index)

    def record_path(self, rank: int) -> Path:
        return RunDir(self.run).trial_record(self.index, rank)

    @property
    def tokens_per_iter(self) -> int:
        return int(self.trainer_config["train"]["global_batch_size"]) * int(
            self.trainer_config["model"]["seq_length"])


class TrialMeasured(Exception):
    """Raised by the trial's step hook after the last measured interval: the trial is done (no final save)."""


def trial_config(base: dict[str, Any], overrides: dict[str, dict[str, Any]], run_dir: str, index: int,
                 a: AutotuneConfig) -> dict[str, Any]:
    """The run's trainer config (``base``) at a candidate layout, as trial ``index`` of the run runs it:
    its own directory, no checkpoint loaded or kept, no evaluation, no W&B, the trial's cadence."""
    cfg = json.loads(json.dumps(base))  # a deep copy of plain values
    for section, values in overrides.items():
        cfg[section].update(values)
    trial = RunDir(run_dir).trial(index)
    cfg["train"].update(iters=a.warmup_iters + a.iters + 1, log_interval=a.log_interval, eval_interval=None,
                        save_interval=None, hang_timeout_s=a.hang_timeout_s, preflight=False)
    cfg["checkpoint"].update(dir=str(RunDir(trial).checkpoints), load="none", load_dir=None, keep=1)
    cfg["logging"]["wandb"]["mode"] = "disabled"
    cfg.update(run_dir=str(trial), run_id=f"{base.get('run_id')}-trial{index}")
    return cfg


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def begin(spec: TrialSpec, job: str) -> None:
    """Before a trial's ranks start: its spec (what status and the decision read) and no record of another
    job left in its directory."""
    for path in spec.run_dir.glob(TRIAL_RECORD.format(rank="*")):
        if (read_json(path) or {}).get("job") != job:
            path.unlink(missing_ok=True)
    write_json(spec.spec_path, {**asdict(spec), "job": job, "started": time.time()})


def load_spec(path: str | Path) -> TrialSpec:
    d = read_json(Path(path)) or {}
    return TrialSpec(**{k: d[k] for k in TrialSpec.__dataclass_fields__})


def write_record(spec: TrialSpec, job: str, rank: int, status: str, **fields: Any) -> None:
    record = {"key": spec.key, "job": job, "index": spec.index, "rank": rank, "status": status,
              "node": node_name(), "host": socket.gethostname(), "time": time.time(), **fields}
    write_json(spec.record_path(rank), record)


def failure_reason(err: BaseException) -> str:
    """One line: out of memory (the CUDA allocator's or the host's: trainer.signals.out_of_memory; the
    allocator's own words, the table already names the layout) said as such, else the error."""
    text = next((line for line in str(err).strip().splitlines() if line.strip()), "")
    name = type(err).__name__
    oom = getattr(err, "allocator", None) or out_of_memory(err)
    if oom is not None:
        return f"out of memory: {oom}"[:400]
    return f"{name}: {text}"[:400] if text else name


def measure(spec: TrialSpec) -> dict[str, Any] | None:
    """The trial's measured intervals (after the warm-up) from its metrics file, or None without one."""
    rows = [r for r in read_metrics(spec.run_dir, STEP_MS) if spec.warmup_iters < int(r["iteration"])
            <= spec.last_iter]
    if not rows:
        return None
    steps = [float(r[STEP_MS]) / 1e3 for r in rows]
    step = sum(steps) / len(steps)
    out: dict[str, Any] = {"step_s": step, "tokens_per_s": spec.tokens_per_iter / step,
                           "intervals": len(rows), "step_min_s": min(steps), "step_max_s": max(steps),
                           "peak_mem_gb": max(float(r.get(_PEAK_MEM, 0.0)) for r in rows)}
    for name, key in _PERF.items():
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        out[name] = sum(values) / len(values) if values else None
    return out


def _on_step(spec: TrialSpec, rank: int):
    """The trial's step hook: the test seam's (a trial made to fail on purpose), then the end of the
    measurement."""
    fault = faults.hook("trial_on_step", spec.index, rank)

    def on_step(iteration: int, loss: float) -> None:
        if fault is not None:
            fault(iteration, loss)
        if iteration > spec.last_iter:
            raise TrialMeasured(f"trial {spec.index} measured through iteration {spec.last_iter}")

    return on_step


def run_rank(spec: TrialSpec, job: str) -> None:
    """This process's rank of trial ``spec`` (torch.distributed's variables set): train, measure, record.
    Raises what failed (after recording it), so the job's other ranks are ended."""
    import torch.distributed as dist

    from trainer.config import RunConfig
    from trainer.run import RunHooks, run

    rank = int(os.environ.get("RANK", "0"))
    if faults.plugin() is not None:
        faults.warn_active(log, os.environ)
    try:
        result = run(RunConfig.from_dict(spec.trainer_config), RunHooks(on_step=_on_step(spec, rank)))
        if result.exit_code:
            raise RuntimeError(result.reason or f"the trainer stopped with exit code {result.exit_code} "
                               f"at iteration {result.iteration} (a stop signal: the time limit?)")
    except TrialMeasured:
        pass
    except BaseException as err:
        write_record(spec, job, rank, FAILED, reason=failure_reason(err))
        raise
    finally:
        if rank == 0:
            shutil.rmtree(RunDir(spec.run_dir).checkpoints, ignore_errors=True)
    if rank == 0:
        found = measure(spec)
        if found is None:
            write_record(spec, job, rank, FAILED, reason="no measured interval in the metrics file")
        else:
            write_record(spec, job, rank, MEASURED, measured=found)
            log.info("trial %d (%s): %.1f tokens/s, %.4f s/iteration", spec.index, spec.name,
                     found["tokens_per_s"], found["step_s"])
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(spec: TrialSpec, world: int, job: str, spec_path: Path) -> list[subprocess.Popen]:
    logs = RunDir(spec.run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    procs = []
    for rank in range(world):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(logs / f"rank{rank}.log", "w", encoding="utf-8") as out:
            # -c, not -m: runpy would execute a second copy of this module, which the package has imported
            cmd = [sys.executable, "-u", "-c", _RANK_MAIN, str(spec_path), job]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()


def _wait(procs: list[subprocess.Popen], deadline: float) -> tuple[int | None, int | None]:
    """Wait until every rank ended, or one failed (the others are ended), or ``deadline`` (all ended);
    (the first failed rank, its exit code), (None, None) when all succeeded, (None, -1) at the deadline."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            _kill(procs)
            return failed, codes[failed]
        if all(c == 0 for c in codes):
            return None, None
        if time.monotonic() > deadline:
            _kill(procs)
            return None, -1
        time.sleep(0.2)


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def silent_reason(spec: TrialSpec, rank: int, code: int, started: float) -> str:
    """Why a rank that recorded nothing ended: a hang its watchdog caught, a signal, or its exit code."""
    hangs = [h for h in read_hangs(str(spec.run_dir)) if float(h.get("time", 0)) >= started]
    if code == EXIT_HANG and hangs:
        h = hangs[0]
        return (f"hang: no training progress for {h.get('idle_s')} s at iteration {h.get('iteration')} "
                f"(the watchdog ended rank {h.get('reporter')}, autotune.hang_timeout_s)")
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"rank {rank} was killed by {name} (out of host memory?)"
    tail = _last_line(RunDir(spec.run_dir).logs / f"rank{rank}.log")
    return f"rank {rank} exited with code {code}" + (f": {tail}" if tail else "")


def run_local(trials: list[TrialSpec], world: int, job: str, limit_s: float) -> list[str]:
    """The local executor's tuning: each trial in turn as ``world`` rank processes (module docstring);
    one line per trial."""
    out = []
    for spec in trials:
        begin(spec, job)
        started = time.time()
        rank, code = _wait(_start_ranks(spec, world, job, spec.spec_path), time.monotonic() + limit_s)
        if code == -1:
            write_record(spec, job, 0, FAILED, reason=f"time limit: no result after {limit_s / 60:.1f} min "
                         "(autotune.time_limit_min)")
        elif rank is not None and not spec.record_path(rank).exists():
            write_record(spec, job, rank, FAILED, reason=silent_reason(spec, rank, code, started))
        shutil.rmtree(RunDir(spec.run_dir).checkpoints, ignore_errors=True)
        record = read_json(spec.record_path(rank or 0)) or {}
        line = (f"trial {spec.index} ({spec.name}): " + (f"{record['measured']['tokens_per_s']:.1f} tokens/s"
                if record.get("status") == MEASURED else f"failed: {record.get('reason', 'no record')}"))
        log.info("%s", line)
        out.append(line)
    return out


_RANK_MAIN = "import sys; from orchestrator.stages.trials import main; sys.exit(main())"


def main(argv: list[str] | None = None) -> int:
    """One rank of a local trial, ``SPEC JOB`` on the command line (run_local starts them)."""
    args = sys.argv[1:] if argv is None else argv
    run_rank(load_spec(args[0]), args[1])
    return 0

"""Training metrics: Megatron-format log lines, throughput (tokens/s, TFLOP/s per GPU, MFU), peak memory,
and Weights & Biases.

W&B rules: only global rank 0 creates a run. Its id is persisted in ``{run_dir}/wandb_run.json`` (created
from ``run_id`` when the orchestrator minted one) so a resumed or requeued run continues the same W&B run
(``resume="allow"``); the file also records the last logged step, and after a restart steps up to it are
not logged again (a crash after logging step 35 and checkpointing 30 replays 31..35 identically; W&B
would otherwise receive them twice). The API key comes only from the environment or netrc, is checked
before training starts in online mode, and is never written by Slipway.
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import string
from dataclasses import dataclass

import torch

from trainer.devices import find_gpu, known_names
from trainer.log import get_logger
from trainer.run_files import METRICS, RunDir
from trainer.wandb_key import has_wandb_key, missing_key_message
from trainer.wandb_online import (
    FALLBACK_KEY,
    WandbError,
    base_url,
    offline_dirs,
    probe,
    sync_command,
    unreachable_message,
)

log = get_logger(__name__)

def detect_peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """The configured peak, else the GPU's dense bf16 peak from the device table (trainer/devices.py), else
    None (CPU: no MFU)."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    gpu = find_gpu(name)
    if gpu is not None:
        return gpu.tflops_16bit
    log.warning("unknown GPU %r: MFU not reported (set logging.peak_tflops; known: %s)", name, known_names())
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak resident set size on CPU, in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


@dataclass
class IntervalStats:
    """Accumulated between two log lines (Megatron's ``total_loss_dict``)."""

    loss_sum: float = 0.0
    advanced: int = 0  # iterations whose update was applied
    skipped: int = 0  # fp16 overflow iterations
    nan: int = 0
    grad_norm: float | None = None  # of the last applied iteration
    iters: int = 0
    elapsed_s: float = 0.0

    def add(self, loss: float, applied: bool, grad_norm: float | None, seconds: float) -> None:
        self.iters += 1
        self.elapsed_s += seconds
        if applied:
            self.advanced += 1
            self.loss_sum += loss
            self.grad_norm = grad_norm
        else:
            self.skipped += 1
            if not math.isfinite(loss):
                self.nan += 1


@dataclass(frozen=True)
class Throughput:
    """What a log line reports about speed, computed from an interval."""

    ms_per_iter: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float | None
    peak_mem_gb: float


def throughput(stats: IntervalStats, flops_per_iter: float, tokens_per_iter: int, world_size: int,
               peak_tflops: float | None, peak_mem_gb: float) -> Throughput:
    """Rates over one logging interval; ``flops_per_iter`` is :func:`trainer.formulas.flops_per_iteration`."""
    per_iter = stats.elapsed_s / max(stats.iters, 1)
    tflops = flops_per_iter / max(per_iter, 1e-12) / world_size / 1e12
    return Throughput(ms_per_iter=per_iter * 1e3, tokens_per_s=tokens_per_iter / max(per_iter, 1e-12),
                      tflops_per_gpu=tflops, mfu=tflops / peak_tflops if peak_tflops else None,
                      peak_mem_gb=peak_mem_gb)


@dataclass(frozen=True)
class StepReport:
    """One log line's values besides throughput."""

    iteration: int
    train_iters: int
    consumed_samples: int
    lr: float
    global_batch_size: int
    loss_scale: float
    kernel_fallbacks: tuple[str, ...] = ()  # ops the start-up self-check switched to eager


def interval_metrics(r: StepReport, s: IntervalStats, t: Throughput) -> dict:
    """The log line's values as W&B metrics (same numbers the line prints)."""
    m = {"train/lr": r.lr, "train/consumed_samples": r.consumed_samples,
         "train/global_batch_size": r.global_batch_size, "train/loss_scale": r.loss_scale,
         "train/skipped_iters": s.skipped, "train/nan_iters": s.nan, "perf/ms_per_iter": t.ms_per_iter,
         "perf/tokens_per_s": t.tokens_per_s, "perf/tflops_per_gpu": t.tflops_per_gpu,
         "perf/peak_mem_gb": t.peak_mem_gb}
    if s.advanced:
        m["train/lm_loss"] = s.loss_sum / s.advanced
    if s.grad_norm is not None:
        m["train/grad_norm"] = s.grad_norm
    if t.mfu is not None:
        m["perf/mfu"] = t.mfu
    if r.kernel_fallbacks:
        m["train/kernel_fallbacks"] = len(r.kernel_fallbacks)
    return m


def format_log_line(r: StepReport, s: IntervalStats, t: Throughput) -> str:
    """Megatron's ``training_log`` line, plus tokens/s, TFLOP/s per GPU, MFU and peak memory."""
    line = f" iteration {r.iteration:8d}/{r.train_iters:8d} |"
    line += f" consumed samples: {r.consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {t.ms_per_iter:.1f} |"
    line += f" learning rate: {r.lr:.3E} |"
    line += f" global batch size: {r.global_batch_size:5d} |"
    if s.advanced:
        line += f" lm loss: {s.loss_sum / s.advanced:.6E} |"
    line += f" loss scale: {r.loss_scale:.1f} |"
    if s.grad_norm is not None:
        line += f" grad norm: {s.grad_norm:.3f} |"
    line += f" number of skipped iterations: {s.skipped:3d} |"
    line += f" number of nan iterations: {s.nan:3d} |"
    line += f" tokens per second: {t.tokens_per_s:.1f} |"
    line += f" throughput per GPU (TFLOP/s/GPU): {t.tflops_per_gpu:.1f} |"
    if t.mfu is not None:
        line += f" MFU: {100 * t.mfu:.1f}% |"
    line += f" peak memory (GB): {t.peak_mem_gb:.2f} |"
    if r.kernel_fallbacks:
        line += f" kernels on eager fallback: {','.join(r.kernel_fallbacks)} |"
    return line


def format_eval_line(iteration: int, loss: float) -> str:
    """Megatron's validation line (PPL from the loss clamped at 20, as Megatron does)."""
    ppl = math.exp(min(20.0, loss))
    return (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} | ")


def check_wandb_credentials(mode: str) -> None:
    """Fail fast (before any training) when online mode has no API key (trainer/wandb_key.py)."""
    if mode == "online" and not has_wandb_key(os.environ):
        raise WandbError(
            f"{missing_key_message(os.environ)}. Export WANDB_API_KEY in the job's environment, or set "
            "logging.wandb.mode=offline (sync later with `wandb sync`) or disabled.")


def online_or_offline(wandb_cfg) -> tuple[str, str | None]:
    """(the mode to start W&B in, why online fell back to offline or None): online only when the bounded
    probe (trainer.wandb_online) reached the W&B server, unless ``require_online`` makes that an error."""
    if wandb_cfg.mode != "online":
        return wandb_cfg.mode, None
    p = probe(base_url())
    if p.reason is None:
        return "online", None
    why = unreachable_message(p)
    if wandb_cfg.require_online:
        raise WandbError(f"{why} and logging.wandb.require_online=true. Give the compute nodes a route to "
                         "W&B (or an HTTPS_PROXY), or set require_online=false to log offline and sync later")
    return "offline", why


class WandbLogger:
    """The W&B face of the trainer (a no-op on ranks other than 0 or when disabled)."""

    def __init__(self, wandb_cfg, run_dir: str, run_id: str | None, config: dict, enabled: bool,
                 start: int | None = 0) -> None:
        """``start``: the iteration this job resumes from (its checkpoint's); None for a job that trains
        nothing and only adds to the run after its last logged step (the eval stage)."""
        self.run = None
        self.id: str | None = None
        self.state_path = str(RunDir(run_dir).wandb_run)
        self.resume_after = -1
        if not enabled or wandb_cfg.mode == "disabled":
            return
        import wandb

        state = _read_json(self.state_path)
        wid = state.get("id") or run_id or _new_run_id()
        os.makedirs(run_dir, exist_ok=True)
        mode, fallback = online_or_offline(wandb_cfg)
        resume, self.resume_after = _resume(wid, int(state.get("last_step", -1)), start, mode, run_dir)
        try:
            self.run = wandb.init(
                mode=mode, project=wandb_cfg.project, entity=wandb_cfg.entity, group=wandb_cfg.group,
                name=wandb_cfg.name, tags=wandb_cfg.tags or None, dir=run_dir, **resume,
                config=config, settings=wandb.Settings(silent=True, console="off"))
        except Exception as e:  # noqa: BLE001 - W&B's own errors have no common base class
            raise WandbError(f"W&B could not start ({mode} mode, {type(e).__name__}: {e}); set "
                             "logging.wandb.mode=offline or disabled to train without it") from e
        self.id = wid
        self.last_step = self.resume_after
        # An earlier job's fallback stays recorded: its offline files still need `wandb sync`.
        record = {**state, "id": wid, "last_step": self.last_step}
        if fallback:
            folder = os.path.dirname(self.run.dir.rstrip("/"))  # <run_dir>/wandb/offline-run-<time>-<id>
            # Every folder of the run so far (an earlier job's too): one command uploads them all.
            sync = sync_command(offline_dirs(os.path.dirname(folder), wid) or [folder])
            record[FALLBACK_KEY] = {"reason": fallback, "sync": sync}
            log.warning("%s: logging offline to %s instead; upload later with `%s` (or set "
                        "logging.wandb.require_online=true to fail instead)", fallback, folder, sync)
        self._record = record
        _write_json(self.state_path, record)
        log.info("W&B run %s (%s, %s)%s", wid, mode, self.run.dir,
                 f"; steps <= {self.resume_after} already logged" if self.resume_after >= 0 else "")

    @property
    def run_id(self) -> str | None:
        """The W&B run id (kept after ``finish``); None when W&B is off on this rank."""
        return self.id

    def log(self, metrics: dict, step: int) -> None:
        """Log at ``step`` unless a previous process already logged it (see module docstring)."""
        if self.run is None or step <= self.resume_after:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as e:  # noqa: BLE001 - a monitoring outage must not stop training
            log.warning("W&B: logging step %d failed (%s: %s); training continues, the values are in %s",
                        step, type(e).__name__, e, METRICS)
            return
        if step > self.last_step:
            self.last_step = step
            self._record["last_step"] = step
            _write_json(self.state_path, self._record)

    def finish(self, exit_code: int = 0) -> None:
        """End the W&B run and W&B's service. Its errors (a dropped connection to the W&B service after a
        scancel, say) are logged, never raised: a logger must not turn a clean stop (exit 0 or 75) into a
        failure. Tearing the service down here leaves W&B's own atexit hook nothing to do, so a requeue or
        cancel does not end with its ConnectionResetError traceback."""
        if self.run is None:
            return
        import wandb

        run, self.run = self.run, None
        for what, step in (("finishing the run", lambda: run.finish(exit_code=exit_code)),
                           ("shutting down its service", wandb.teardown)):
            try:
                step()
            except (Exception, SystemExit) as e:  # noqa: BLE001 - see above; teardown may sys.exit
                log.warning("W&B: %s failed (%s: %s); the run's exit code stands (%d). Upload what was "
                            "written with `wandb sync`", what, type(e).__name__, e, exit_code)


def can_rewind() -> bool:
    """Whether the installed wandb can rewind a run (``wandb.init(resume_from="<id>?_step=<n>")``, beta
    since wandb 0.17.1); only a W&B server applies it, so only online runs use it."""
    import inspect

    import wandb

    return "resume_from" in inspect.signature(wandb.init).parameters


def _resume(wid: str, last: int, start: int | None, mode: str, run_dir: str) -> tuple[dict, int]:
    """How this job continues W&B run ``wid`` (wandb.init's arguments) and the last step it must not log
    again. An earlier job may have logged past this job's checkpoint (a crash after logging, or a relaunch
    from an earlier checkpoint): online, the run is rewound to ``start`` so W&B's history is what the
    metrics file holds; otherwise those steps keep their earlier values, and the log says so. ``start``
    None: the job replays no iteration (the eval stage), so nothing logged earlier is in question."""
    if start is None or start >= last:
        return {"id": wid, "resume": "allow"}, last
    if mode == "online" and can_rewind():
        log.info("W&B: rewinding run %s to step %d: steps %d..%d logged by an earlier job are replaced by "
                 "this job's", wid, start, start + 1, last)
        return {"resume_from": f"{wid}?_step={start}"}, start
    why = "an offline run cannot be rewound" if mode == "offline" else "this wandb cannot rewind a run"
    log.warning("W&B: run %s already holds steps %d..%d, logged by an earlier job; this job resumes from "
                "iteration %d and %s, so W&B keeps the earlier values of those steps and logs from step %d "
                "on. %s holds this job's values for every step", wid, start + 1, last, start, why, last + 1,
                RunDir(run_dir).metrics)
    return {"id": wid, "resume": "allow"}, last


def _new_run_id() -> str:
    """Eight lowercase alphanumerics, W&B's run-id style."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(tmp, path)

"""What the training loop needs from the host without waiting for the device (issue 39).

A step queues its work (forward, backward, gradient sync, the norm and clipping, the optimizer) and the
host goes on to read the next batch while the device runs. Anything that reads a device value on the host
(``.item()``, ``float()``, ``bool()`` of a tensor, ``torch.cuda.synchronize``) stops that overlap: the
loop does it only at its synchronisation points (a log line, an evaluation, a save, a stop, the end, or
every iteration when a caller's ``on_step`` hook wants the loss as a float). Here:

- :class:`Pending`: the iterations whose loss and gradient norm are still device tensors, read back in
  one transfer at the next synchronisation point;
- :class:`Clock`: wall time between synchronisation points (the device is synchronised before the clock
  is read, so the time of the queued work is counted where it ran);
- :class:`StopAgreement`: the ranks agree on a stop signal (and on a failed background save) every
  iteration on the host alone (a world of one reads its own flags; otherwise a MAX all-reduce of a host
  tensor over a gloo group: never a device collective, never a read of device memory);
- :func:`to_device`: batches through pinned memory with non-blocking copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` on ``device``: on CUDA through pinned host memory and a non-blocking copy, so the copy is
    queued behind the work in flight instead of waiting for it (CPU: unchanged)."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


@dataclass
class Pending:
    """Iterations run but not yet read back: (iteration, loss, grad norm, applied), device scalars."""

    iterations: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    applied: list[bool] = field(default_factory=list)

    def add(self, iteration: int, loss: torch.Tensor, norm: torch.Tensor, applied: bool) -> None:
        self.iterations.append(iteration)
        self.losses.append(loss.detach().float().reshape(()))
        self.norms.append(norm.detach().float().reshape(()))
        self.applied.append(applied)

    def __len__(self) -> int:
        return len(self.iterations)

    def take(self) -> list[tuple[int, float, float, bool]]:
        """Every pending iteration as host numbers, in one device-to-host transfer; empties the list."""
        if not self.iterations:
            return []
        values = torch.stack([torch.stack(self.losses), torch.stack(self.norms)]).tolist()
        out = list(zip(self.iterations, values[0], values[1], self.applied, strict=True))
        self.iterations, self.losses, self.norms, self.applied = [], [], [], []
        return out


class Clock:
    """Wall seconds of training between synchronisation points (evaluations and saves excluded)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap or restart, once the device has finished the queued work."""
        device_sync(self.device)
        now = time.perf_counter()
        seconds, self.start = now - self.start, now
        return seconds

    def restart(self) -> None:
        """Start counting again (after an evaluation or a save, which are not training time)."""
        self.start = time.perf_counter()


def host_group() -> dist.ProcessGroup | None:
    """A process group whose collectives run on the host: the default group when it is gloo (CPU
    training), else a new gloo group over the world (collective: every rank calls this, once). None for a
    world of one (nothing to agree with)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


class StopAgreement:
    """All ranks stop together if any rank received a stop signal; checked every iteration on the host.
    The same all-reduce carries a second flag, "a background save failed here"
    (trainer.checkpoint.background), so every rank raises that error at the same step.

    The flags are a host tensor over numpy memory, read through numpy after the all-reduce: no device
    collective and no read of a device value (the reduction over a gloo group is host-to-host)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._buf = np.zeros(2, dtype=np.float32)
        self._flags = torch.from_numpy(self._buf)
        self.save_failed = False  # the last call's agreed second flag

    def __call__(self, requested: bool, save_failed: bool = False) -> bool:
        if self.group is None:
            self.save_failed = save_failed
            return requested
        self._buf[0] = 1.0 if requested else 0.0
        self._buf[1] = 1.0 if save_failed else 0.0
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group)
        self.save_failed = bool(self._buf[1] > 0.0)
        return bool(self._buf[0] > 0.0)

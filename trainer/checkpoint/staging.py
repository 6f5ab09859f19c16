"""The host copy an asynchronous save writes from: the only part of such a save that training waits for.

:meth:`HostStager.prepare` describes a copy of a checkpoint's content whose tensors will live in host
memory that training never touches again; the background writer makes it (:meth:`HostCopy.run`) while
training runs the next step's forward and backward, which read the parameters but change none of them
nor the optimizer's state; the training thread waits for the copy (:meth:`HostCopy.wait`) only before the
next optimizer update, so the copy costs training only the part of it longer than a forward-backward. Then
the writer serialises the copy while the next steps update the live state in place:

- every tensor *storage* is copied once and each tensor is rebuilt as the same view of the copy (offset,
  shape, strides, dtype, Parameter or not): tensors sharing a storage still share one, so ``torch.save``
  of the copy writes the same records, hence the same bytes, as ``torch.save`` of the original;
- the containers (dicts, lists, tuples, Namespaces, ...) are copied with ``copy.deepcopy`` around the
  staged tensors, so an object referenced twice is still one object (the pickle stays the same);
- the host buffers are kept and reused by the next save (same storage sizes: every save of a run), so a
  save after the first pays neither the allocation nor the page faults of a fresh copy;
- on CUDA the buffers are pinned and the copies non-blocking, with one synchronisation at the end
  (pinned memory is what makes a device-to-host copy run at the link's speed). The copy records each
  storage's device (:func:`_location`), so the file names ``cuda:N`` as a synchronous save's does.

Memory: one copy of this rank's checkpoint content in host memory for the rest of the run (the cost of
``checkpoint.async_save``; the performance notes say the same of torch DCP's async save).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch

# Host buffer data pointer → the device its content came from: the location torch.save records for a
# staged storage (its own would say "cpu"; a synchronous save of a CUDA tensor says "cuda:N").
_ORIGIN: dict[int, str] = {}
_ORIGIN_LOCK = threading.Lock()
_REGISTERED = False


def _location(storage: Any) -> str | None:
    """torch.serialization's location tagger for staged buffers (None: not ours, the next tagger)."""
    if getattr(storage, "device", None) is None or storage.device.type != "cpu":
        return None
    return _ORIGIN.get(storage.data_ptr())


def _register_location() -> None:
    global _REGISTERED
    if not _REGISTERED:
        # Priority 5 runs before torch's cpu (10) and cuda (20) taggers; loading is left to those.
        torch.serialization.register_package(5, _location, lambda obj, location: None)
        _REGISTERED = True


class HostStager:
    """Copies of checkpoint content in reusable host buffers (one stager per rank, reused every save)."""

    def __init__(self) -> None:
        self._pool: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self.bytes = 0  # host memory held by the buffers

    def _buffer(self, nbytes: int, pinned: bool, free: dict) -> torch.UntypedStorage:
        spare = free.get((nbytes, pinned))
        if spare:
            return spare.pop()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        self.bytes += nbytes
        return buf

    def stage(self, content: Any) -> Any:
        """A copy of ``content`` whose tensors are in this stager's host buffers (see the module doc), now.
        The buffers of the previous copy are reused: call it again only once that copy is written."""
        return self.prepare(content).run()

    def prepare(self, content: Any) -> HostCopy:
        """The copy of ``content`` to be made later, from another thread (:meth:`HostCopy.run`): training
        may go on meanwhile as long as it changes none of the tensors before :meth:`HostCopy.wait` (the
        loop runs the next step's forward and backward, and waits before the optimizer updates them)."""
        tensors: dict[int, torch.Tensor] = {}
        _collect(content, tensors, set())
        ready = None
        if any(t.is_cuda for t in tensors.values()):  # the copy starts after the work queued so far
            ready = torch.cuda.Event()
            ready.record()
        return HostCopy(self, content, list(tensors.values()), ready)

    def _copy_all(self, content: Any, tensors: list[torch.Tensor]) -> Any:
        free, self._pool = self._pool, {}
        copies: dict[tuple[int, str], torch.UntypedStorage] = {}
        memo: dict[int, Any] = {}
        for t in tensors:
            src = t.untyped_storage()
            key = (src.data_ptr(), str(src.device))
            if key not in copies:
                pinned = src.device.type == "cuda"
                host = self._buffer(src.nbytes(), pinned, free)
                _copy(host, src, pinned)
                copies[key] = host
                self._pool.setdefault((src.nbytes(), pinned), []).append(host)
                if src.device.type != "cpu":
                    _remember_origin(host, src.device)
            memo[id(t)] = _view(copies[key], t)
        for b in (b for bufs in free.values() for b in bufs):  # not reused: freed with this dict
            self.bytes -= b.nbytes()
            _forget(b.data_ptr())
        memo[id(memo)] = tensors  # deepcopy's keep-alive convention
        return copy.deepcopy(content, memo)


class HostCopy:
    """One checkpoint's host copy, made by :meth:`run` (the writer thread; on CUDA on a stream of its own
    that first waits for the work queued before :meth:`HostStager.prepare`) while training goes on;
    :meth:`wait` is where training stops if it would otherwise change a tensor not yet copied."""

    def __init__(self, stager: HostStager, content: Any, tensors: list[torch.Tensor],
                 ready: Any = None) -> None:
        self.stager, self.content, self.tensors, self.ready = stager, content, tensors, ready
        self._done = threading.Event()

    def run(self) -> Any:
        """The copy (sets :meth:`done` even when it fails, so a waiting training thread goes on)."""
        try:
            if self.ready is None:
                return self.stager._copy_all(self.content, self.tensors)
            device = next(t.device for t in self.tensors if t.is_cuda)
            with torch.cuda.device(device):
                stream = torch.cuda.Stream()
                stream.wait_event(self.ready)
                with torch.cuda.stream(stream):
                    staged = self.stager._copy_all(self.content, self.tensors)
                stream.synchronize()
            return staged
        finally:
            self.content = self.tensors = None  # the live state is no longer referenced from here
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Block until the copy is made; the seconds waited."""
        if self._done.is_set():
            return 0.0
        t0 = time.monotonic()
        self._done.wait()
        return time.monotonic() - t0


def _collect(obj: Any, out: dict[int, torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable through dicts, lists, tuples, sets and objects' ``__dict__``."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[id(obj)] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _collect(v, out, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            _collect(v, out, seen)


def _copy(host: torch.UntypedStorage, src: torch.UntypedStorage, non_blocking: bool) -> None:
    """Byte copy through uint8 views (multi-threaded on the CPU, one DMA from a GPU)."""
    if src.nbytes() == 0:
        return
    dst = torch.empty(0, dtype=torch.uint8).set_(host)
    dst.copy_(torch.empty(0, dtype=torch.uint8, device=src.device).set_(src), non_blocking=non_blocking)


def _view(host: torch.UntypedStorage, t: torch.Tensor) -> torch.Tensor:
    """``t``'s view (offset, size, stride, dtype) of the host copy of its storage."""
    out = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    if t.requires_grad and t.is_leaf:
        out.requires_grad_(True)
    return out


def _remember_origin(host: torch.UntypedStorage, device: torch.device) -> None:
    _register_location()
    ptr = host.data_ptr()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _ORIGIN_LOCK:
        _ORIGIN[ptr] = f"{device.type}:{index}"


def _forget(ptr: int) -> None:
    with _ORIGIN_LOCK:
        _ORIGIN.pop(ptr, None)

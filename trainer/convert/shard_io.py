"""Reading and writing the Megatron legacy checkpoint layout (``formats.md`` §4), model part only.

```
{dir}/latest_checkpointed_iteration.txt             # "150000" (no newline) or "release"
{dir}/iter_0150000/mp_rank_00/model_optim_rng.pt     # PP == 1
{dir}/iter_0150000/mp_rank_01_003/model_optim_rng.pt # TP rank 1, PP rank 3
```

The converters own this small piece themselves so they never depend on the training loop: a checkpoint
written by ``from_hf`` at any (tp, pp) can be read back by ``to_hf`` and vice versa. Every problem raises
:class:`CheckpointError` saying what is wrong, where, and what to do.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import pickles

# The names and the error type are the trainer's (one definition of the layout); reading is our own:
# memory-mapped, by the restricted unpickler, and with errors that point at the converter's flags.
from trainer.checkpoint.files import (
    SHARD_DIR_RE,
    SHARD_FILE,
    TRACKER,
    CheckpointError,
    iter_path,
    shard_dir_name,
)
from trainer.checkpoint.files import read_tracker as ckpt_read_tracker
from trainer.log import get_logger

log = get_logger(__name__)


def read_tracker(checkpoint_dir: Path) -> int:
    """The iteration ``latest_checkpointed_iteration.txt`` names (Megatron's ``release``: 0, as Megatron
    reads it), by the trainer's one reader; the converter adds what a user of its CLI needs to hear."""
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    try:
        iteration = ckpt_read_tracker(str(checkpoint_dir))
    except CheckpointError as e:
        raise CheckpointError(f"{e} (the save was interrupted?); or pass --iteration N") from None
    if iteration is None:
        found = sorted(p.name for p in checkpoint_dir.glob("iter_*"))
        hint = f"; it holds {found[-3:]}: pass --iteration N" if found else " and holds no iter_* folders"
        raise CheckpointError(f"{checkpoint_dir} has no {TRACKER} (not a finished Megatron/Slipway "
                              f"checkpoint){hint}")
    return iteration


def iteration_path(checkpoint_dir: Path, iteration: int | None) -> tuple[Path, int]:
    """The folder of ``iteration`` (the tracker's when None), checked to exist; iteration 0 is Megatron's
    ``release`` folder when there is no ``iter_0000000``."""
    from_tracker = iteration is None
    if from_tracker:
        iteration = read_tracker(checkpoint_dir)
    path = Path(iter_path(str(checkpoint_dir), iteration))
    if not path.is_dir():
        found = sorted(p.name for p in checkpoint_dir.glob("iter_*"))
        source = f"{TRACKER} says {iteration}" if from_tracker else f"--iteration {iteration} was asked"
        raise CheckpointError(f"{source} but {path} does not exist (available: {found or 'none'}); "
                              "pass --iteration with one that exists")
    return path, iteration


def prepare_output(out: Path, overwrite: bool) -> None:
    """An empty output folder for a converter: refuse a non-empty one unless ``overwrite``."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"output directory {out} is not empty; pass --overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def discover_layout(iter_dir: Path) -> tuple[int, int]:
    """(tp_size, pp_size) from the shard folders, after checking that every rank's shard is there."""
    ranks = set()
    for child in iter_dir.iterdir():
        m = SHARD_DIR_RE.match(child.name)
        if m and child.is_dir():
            ranks.add((int(m.group(1)), int(m.group(2) or 0)))
    if not ranks:
        raise CheckpointError(f"{iter_dir} holds no mp_rank_* shard folders: incomplete checkpoint")
    tp_size = max(t for t, _ in ranks) + 1
    pp_size = max(p for _, p in ranks) + 1
    expected = [shard_dir_name(t, p, pp_size) for t in range(tp_size) for p in range(pp_size)]
    missing = [f"{d}/{SHARD_FILE}" for d in expected if not (iter_dir / d / SHARD_FILE).is_file()]
    if missing:
        raise CheckpointError(f"{iter_dir} is incomplete for tp={tp_size}, pp={pp_size}: missing "
                              f"{', '.join(missing)} (a rank failed to save, or the copy is partial)")
    return tp_size, pp_size


def load_shard(path: Path | io.BytesIO, trust_pickle: bool = False, where: str | None = None
               ) -> dict[str, Any]:
    """One ``model_optim_rng.pt`` (or torch_dist ``common.pt``, or a torch_dist object's bytes: ``where``
    names it), memory-mapped, by the restricted reader (:mod:`trainer.checkpoint.pickles`: Megatron-LM's
    Namespace args, its classes and standard-library enums load without Megatron and without running
    code). ``trust_pickle`` unpickles anything else too, running code from the file (Megatron's classes
    still become stand-ins)."""
    source = path if isinstance(path, io.BytesIO) else str(path)
    where = where or str(path)
    try:
        if trust_pickle:
            log.warning("%s: --trust-pickle unpickles arbitrary objects: code in the file runs", where)
            return pickles.load_trusted(source)
        return pickles.load(source, where=where)
    except pickles.UnsafePickle as e:
        raise CheckpointError(pickles.refusal(where, e.names, e.how)) from None
    except ModuleNotFoundError as e:  # --trust-pickle: a module the file names is not installed
        raise CheckpointError(f"{where} pickles objects of the Python module {e.name!r}, which "
                              "--trust-pickle imports to unpickle them and which is not installed here: "
                              f"install the package that provides {e.name!r} (or put its source tree on "
                              "PYTHONPATH) and run again with --trust-pickle") from e
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{where} cannot be read ({e.__class__.__name__}: {e}); the file is truncated "
                              "or not a torch checkpoint") from e


def save_shard(path: Path, payload: dict[str, Any]) -> None:
    """Write one shard atomically (a crash never leaves a half-written file under the real name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested Megatron model dict → flat dotted names (already-flat entries pass through)."""
    flat = {}
    for key, value in tree.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat names → Megatron's nesting: ``language_model.embedding.word_embeddings.weight`` nests fully,
    the encoder keeps flat ``layers.{i}...`` keys under ``language_model.encoder`` (as Megatron saves it)."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        if name.startswith("language_model.encoder."):
            parts = ["language_model", "encoder", name.removeprefix("language_model.encoder.")]
        else:
            head, _, leaf = name.rpartition(".")
            parts = [*head.split("."), leaf] if head else [leaf]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree

"""A verified model is replaced only by a verified one: the new one is built beside it, then renamed in.

    <out>/            the model users load: complete and verified, or absent
    <out>.partial/    the conversion in progress (same filesystem, so the swap is a rename). Its config is
                      written as ``config.json.unverified`` and renamed to ``config.json`` only once the
                      model verified, so ``from_pretrained`` refuses a half-written or unverified folder
                      (an ``INVALID`` file in it says why it is not done)
    <out>.previous/   the replaced model, only between the two renames of :func:`commit`

A process killed at any point leaves a loadable verified model: ``<out>`` itself, or — killed between the
two renames — ``<out>.partial`` (the new one, verified) beside ``<out>.previous`` (the old one).
:func:`recover`, which every conversion runs first, finishes such a swap.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer import faults
from trainer.checkpoint.files import fsync_dir
from trainer.log import get_logger
from trainer.run_files import PARTIAL_SUFFIX, PREVIOUS_SUFFIX

log = get_logger(__name__)

CONFIG = "config.json"  # what makes a folder loadable (transformers reads it first)
UNVERIFIED_CONFIG = "config.json.unverified"  # the config until verification passed: loads nothing
INVALID = "INVALID"  # in a folder that is not (yet) a verified model: why


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def previous_dir(out: Path) -> Path:
    return out.with_name(out.name + PREVIOUS_SUFFIX)


def is_verified(folder: Path) -> bool:
    """A folder this converter finished: its config is in place and nothing marks it invalid."""
    return (folder / CONFIG).is_file() and not (folder / INVALID).exists()


def recover(out: Path) -> str | None:
    """Finish a swap that a killed process left between its renames (``<out>`` missing): the verified new
    model is renamed in, else the previous one is put back; a leftover ``<out>.previous`` beside a model in
    place is removed. Returns what was done (None: nothing to do)."""
    partial, previous = partial_dir(out), previous_dir(out)
    done = None
    if not out.exists():
        for candidate, what in ((partial, "the verified new model"), (previous, "the previous model")):
            if candidate.is_dir() and is_verified(candidate):
                os.rename(candidate, out)
                fsync_dir(str(out.parent))
                done = (f"{out} was missing (a conversion was stopped mid-swap): renamed {what} {candidate} "
                        "there")
                log.warning("%s", done)
                break
    if out.exists() and previous.exists():
        shutil.rmtree(previous)
        done = done or f"removed {previous}, left by a swap that had finished"
    return done


def begin(out: Path, overwrite: bool) -> Path:
    """An empty ``<out>.partial`` to convert into, after :func:`recover`; refuses a non-empty ``out`` that
    would be replaced unless ``overwrite``. A partial folder an earlier attempt left is removed."""
    recover(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {out} is not empty; pass --overwrite to replace it")
    partial = partial_dir(out)
    if partial.exists():
        log.info("removing %s, left by a conversion that did not finish", partial)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / INVALID).write_text("conversion did not finish\n")
    return partial


def mark_verified(partial: Path) -> None:
    """The model in ``partial`` passed verification: its config becomes loadable, the INVALID note goes."""
    os.replace(partial / UNVERIFIED_CONFIG, partial / CONFIG)
    (partial / INVALID).unlink()


def mark_invalid(partial: Path, reason: str) -> None:
    """Leave ``partial`` for inspection, not loadable, saying why."""
    (partial / CONFIG).unlink(missing_ok=True)
    (partial / INVALID).write_text(reason.rstrip() + "\n")


def commit(partial: Path, out: Path) -> None:
    """Swap the verified ``partial`` in as ``out``: the old ``out`` aside, the new one in, the old one
    deleted. Until the second rename the old model stays loadable; see the module docstring for a kill."""
    if not is_verified(partial):
        raise RuntimeError(f"{partial} is not a verified model; refusing to put it in place of {out}")
    previous = previous_dir(out)
    if previous.exists():
        shutil.rmtree(previous)
    if out.exists():
        os.rename(out, previous)
        faults.at("convert:between_renames")
    os.rename(partial, out)
    fsync_dir(str(out.parent))
    shutil.rmtree(previous, ignore_errors=True)

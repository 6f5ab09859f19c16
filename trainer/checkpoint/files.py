"""The checkpoint folder's names and its tracker (``formats.md`` §4), shared by the trainer and ``convert/``.

Layout::

    {dir}/latest_checkpointed_iteration.txt            the bare iteration number, no newline ("release": 0)
    {dir}/iter_{N:07d}/mp_rank_{tp:02d}/model_optim_rng.pt          pp_size == 1
    {dir}/iter_{N:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt pp_size > 1
    {dir}/iter_{N:07d}/{.metadata, __R_I.distcp, common.pt, metadata.json}  checkpoint.format=torch_dist

Torch-free: the orchestrator reads trackers and folders at plan time.
"""

from __future__ import annotations

import os
import re
from typing import Any

CHECKPOINT_VERSION = 3.0  # Megatron's: QKV rows per head as [heads, 3, head_dim]
TRACKER = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
# Megatron-core torch_dist: torch.distributed.checkpoint metadata, Megatron's common (non-tensor) part and
# its format record, with the content Megatron-core 0.8-0.16 write (dist_checkpointing/core.py).
DIST_METADATA, DIST_COMMON, DIST_INFO = ".metadata", "common.pt", "metadata.json"
DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
               "common_backend_version": 1}
SHARD_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def arg(args: Any, key: str, default: Any = None) -> Any:
    """``args.key`` of a checkpoint, else ``default``: Slipway's checkpoints before the Namespace form
    (``megatron_args``) carry a dict, Megatron-LM's and newer Slipway ones an ``argparse.Namespace``."""
    if args is None:
        return default
    if isinstance(args, dict):
        return args.get(key, default)
    return getattr(args, key, default)


# The model fields a checkpoint must share with the configured model to be loaded (the trainer refuses
# otherwise, trainer/run/entry.py; a launch refuses earlier, orchestrator/checks/checkpoints.py).
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "vocab_size")


def model_differences(args: Any, configured: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, configured)} for every :data:`MODEL_KEYS` field where a checkpoint's ``args``
    (Namespace or dict) and the configured model differ; a field either side leaves unset is skipped."""
    return {k: (arg(args, k), configured.get(k)) for k in MODEL_KEYS
            if arg(args, k) is not None and configured.get(k) is not None and arg(args, k) != configured[k]}


# The architecture fields (ModelConfig.megatron_architecture's names) that must match for the weights to
# mean the same computation; the rotary ones only with rope.
ARCH_KEYS = ("position_embedding_type", "normalization", "norm_epsilon", "swiglu", "add_bias_linear",
             "untie_embeddings_and_output_weights", "num_query_groups")
ROPE_KEYS = ("rotary_base", "rotary_percent")


def _kv_groups(args: Any) -> Any:
    """KV heads as both sides count them: Megatron-LM leaves num_query_groups at 1 (its default) unless
    --group-query-attention is set, so without it the groups are the heads."""
    if arg(args, "group_query_attention") is False:
        return arg(args, "num_attention_heads")
    return arg(args, "num_query_groups")


def architecture_differences(args: Any, configured: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, configured)} where a checkpoint's architecture (rope, RMSNorm, SwiGLU, GQA, biases,
    untied head, epsilon, rotary base) differs from ``configured`` (ModelConfig.megatron_architecture);
    a field the args leave out (older checkpoints) is skipped. Shapes alone do not tell these apart: a
    GPT-2 and a Llama layer of one size load into each other's parameters and compute something else."""
    saved = {k: arg(args, k) for k in ARCH_KEYS}
    saved["num_query_groups"] = _kv_groups(args)
    keys = ARCH_KEYS + (ROPE_KEYS if configured.get("position_embedding_type") == "rope" else ())
    saved.update({k: arg(args, k) for k in ROPE_KEYS})

    def same(a: Any, b: Any) -> bool:
        return float(a) == float(b) if isinstance(a, int | float) and isinstance(b, int | float) else a == b

    return {k: (saved[k], configured.get(k)) for k in keys
            if saved[k] is not None and configured.get(k) is not None and not same(saved[k], configured[k])}


def config_differences(args: Any, model: Any) -> dict[str, tuple[Any, Any]]:
    """Every difference the trainer refuses a checkpoint for, between its ``args`` and a ``ModelConfig``:
    the shape (:func:`model_differences`) and the architecture (:func:`architecture_differences`). The one
    comparison both the training job and the login node's relaunch check make."""
    wrong = model_differences(args, {k: getattr(model, k) for k in MODEL_KEYS})
    wrong.update(architecture_differences(args, model.megatron_architecture()))
    return wrong


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message says what is wrong and how to fix it."""


class CheckpointSpaceError(CheckpointError):
    """Not enough free space to write a checkpoint; nothing was committed (the previous one is intact)."""


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def iter_path(ckpt_dir: str, iteration: int) -> str:
    """``iter_N``, or ``release`` when only Megatron's release folder exists for iteration 0."""
    path = os.path.join(ckpt_dir, iter_dir_name(iteration))
    release = os.path.join(ckpt_dir, "release")
    if iteration == 0 and not os.path.isdir(path) and os.path.isdir(release):
        return release
    return path


def list_iterations(ckpt_dir: str) -> list[int]:
    """Iterations that have an ``iter_N`` folder (complete or not), ascending."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := ITER_DIR_RE.match(n)))


def tracker_text(ckpt_dir: str) -> str | None:
    """The tracker's content, stripped; None when there is no tracker."""
    try:
        with open(os.path.join(ckpt_dir, TRACKER), encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (the entry lives in the folder)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(ckpt_dir: str, iteration: int | str, before_commit=None) -> None:
    """Megatron's tracker, the bare iteration with no newline (or ``release``), written last: the commit
    point of a checkpoint. Through a fsync'd temporary renamed over the tracker and a fsync of the folder,
    so a reader sees the old iteration or the new one, never a partial file, and a crash after this
    returns keeps the new one. ``before_commit`` runs between the temporary and the rename (the save
    protocol's failpoint)."""
    tmp = os.path.join(ckpt_dir, f"{TRACKER}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    if before_commit is not None:
        before_commit()
    os.replace(tmp, os.path.join(ckpt_dir, TRACKER))
    fsync_dir(ckpt_dir)


def parse_tracker(text: str | None) -> int | None:
    """The iteration a tracker's text names (0 for Megatron's ``release``); None if it names none."""
    if text == "release":
        return 0
    return int(text) if text is not None and text.isdigit() else None


def shard_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron's shard folder: the pp rank appears only when there is more than one stage."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


def shard_path(ckpt_dir: str, iteration: int | str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(ckpt_dir, iter_dir_name(iteration), shard_dir_name(tp_rank, pp_rank, pp_size),
                        SHARD_FILE)


def read_tracker(ckpt_dir: str) -> int | None:
    """The committed iteration (0 for Megatron's ``release``), or None when there is no checkpoint."""
    text = tracker_text(ckpt_dir)
    it = parse_tracker(text)
    if text is not None and it is None:
        raise CheckpointError(f"{ckpt_dir}/{TRACKER} holds {text!r}, not an iteration number. Write the "
                              f"iteration of a complete checkpoint into it ({list_iterations(ckpt_dir)[-3:]} "
                              "exist), or set checkpoint.load to one of them")
    return it

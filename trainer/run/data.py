"""The data side of a run (``trainer.run``): dataset prefixes → GPT train/valid datasets → per-rank
micro-batches.

Glue only: the datasets, index caches and the resumable sampler are ``trainer.data``'s. The train stream
starts at ``consumed_train_samples`` and the validation stream at ``consumed_valid_samples`` (Megatron's
validation iterator continues across evaluations), so a resumed run reads exactly what an uninterrupted
one would. Every rank of a (tp, pp) column reads the same micro-batches; DP ranks read their slices.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from trainer import formulas
from trainer.config import ModelConfig, TokenizerConfig
from trainer.data.blend import parse_blend
from trainer.data.blended_dataset import BlendRequest, build_blended_datasets
from trainer.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.data.indexed_dataset import IndexedDataset, index_file_path, merge_datasets
from trainer.data.sampler import SamplerConfig, micro_batches
from trainer.data.splits import samples_drawn
from trainer.log import get_logger
from trainer.parallel import ParallelState
from trainer.restore.state import TrainState
from trainer.run_files import document_prefix

log = get_logger(__name__)


def resolve_prefix(path: str, json_key: str) -> str:
    """A dataset prefix: ``path`` itself when ``path.idx`` exists, else ``{path}_{json_key}_document``."""
    for candidate in (path, document_prefix(path, json_key)):
        if os.path.exists(index_file_path(candidate)):
            return candidate
    if path.endswith((".jsonl", ".json", ".gz")):
        raise FileNotFoundError(f"data.paths entry {path!r} is raw JSON; the trainer reads preprocessed "
                                "data: run `python -m trainer.data.preprocess` and pass its output prefix")
    raise FileNotFoundError(f"no dataset at {path!r}: neither {path}.idx nor "
                            f"{document_prefix(path, json_key)}.idx exists; set data.paths to preprocessed "
                            "prefixes")


def _merged_prefix(prefixes: list[str], run_dir: str, rank: int) -> str:
    """Several prefixes are concatenated once (rank 0) into the run directory; others wait."""
    key = hashlib.sha256("\n".join(os.path.abspath(p) for p in prefixes).encode()).hexdigest()[:16]
    out = os.path.join(run_dir, "data", f"merged-{key}")
    if rank == 0 and not os.path.exists(index_file_path(out)):
        log.info("merging %d datasets into %s", len(prefixes), out)
        merge_datasets(prefixes, out)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def _stream(dataset, consumed: int, micro_batch_size: int, ps: ParallelState) -> Iterator[dict]:
    """This rank's micro-batches from ``consumed`` on, in the engine's format (tokens, labels)."""
    cfg = SamplerConfig(total_samples=len(dataset), consumed_samples=consumed,
                        micro_batch_size=micro_batch_size, dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    for batch in micro_batches(dataset, cfg):
        yield {"tokens": batch["inputs"], "labels": batch["labels"]}


@dataclass(frozen=True)
class DataShape:
    """What the data side needs besides the config slices."""

    seq_length: int
    global_batch_size: int
    run_dir: str


def build_data(data, train, shape: DataShape, ps: ParallelState, state: TrainState
               ) -> tuple[Iterator | None, Iterator | None]:
    """(train stream, validation stream) from the ``data`` and ``train`` config slices."""
    global_batch_size, run_dir = shape.global_batch_size, shape.run_dir
    if not data.paths:
        raise ValueError("data.paths is empty: set it to the preprocessed dataset prefix(es)")
    blend = parse_blend(data.paths)
    prefixes = [resolve_prefix(p, data.json_key) for p in blend.paths]
    wants = samples_drawn(train.iters, global_batch_size, train.eval_interval, train.eval_iters)
    config = GPTDatasetConfig(seq_length=shape.seq_length, seed=train.seed, split=data.split,
                              cache_dir=data.cache_dir)
    if blend.weights is not None:  # Megatron's weighted blend: each corpus split and sized on its own
        request = BlendRequest([IndexedDataset(p) for p in prefixes], prefixes, blend.normalized)
        datasets = build_blended_datasets(request, wants, config, is_builder=ps.rank == 0)
    else:  # several unweighted prefixes are concatenated into one dataset
        prefix = prefixes[0] if len(prefixes) == 1 else _merged_prefix(prefixes, run_dir, ps.rank)
        datasets = build_gpt_datasets(IndexedDataset(prefix), prefix, wants, config, is_builder=ps.rank == 0)
    train_stream = valid_stream = None
    if state.iteration < train.iters:
        train_stream = _stream(datasets["train"], state.consumed_train_samples, train.micro_batch_size, ps)
    if datasets.get("valid") is not None:
        valid_stream = _stream(datasets["valid"], state.consumed_valid_samples, train.micro_batch_size, ps)
    return train_stream, valid_stream


def resolve_vocab(model: ModelConfig, tokenizer: TokenizerConfig) -> tuple[int, int | None]:
    """(vocab_size, end-of-document id) from model.vocab_size, else the tokenizer's vocab.json or, for
    HuggingFaceTokenizer, len(tokenizer) (Megatron's vocab_size for it)."""
    eod = None
    if tokenizer.type == HF_TOKENIZER_TYPE and tokenizer.model:
        from trainer.data.hf_tokenizer import load_hf_tokenizer

        tok = load_hf_tokenizer(tokenizer.model)
        size, eod = formulas.model_vocab_size(model.vocab_size, tok.vocab_size), tok.eod_id
    elif tokenizer.vocab_file:
        from trainer.data.tokenizer import read_vocab

        vocab = read_vocab(tokenizer.vocab_file)
        eod = vocab.get("<|endoftext|>")
        size = formulas.model_vocab_size(model.vocab_size, len(vocab))
    else:
        size = formulas.model_vocab_size(model.vocab_size, tokenizer.vocab_size)
    if not size:
        raise ValueError("the vocabulary size is unknown: set tokenizer.vocab_file (vocab.json), "
                         "tokenizer.model (HuggingFaceTokenizer) or model.vocab_size")
    return size, eod

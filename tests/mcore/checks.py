"""The Megatron side of the oracle tests: run as ``python -m tests.mcore.checks --serve`` (a worker,
``harness.run_check``) or ``NAME JSON_KWARGS`` with one megatron-core version on ``sys.path``. Only
Megatron's code computes here; results go to the files named in the kwargs and one JSON line on stdout.

Nothing from ``trainer`` is imported: the expected side must not share code with what it checks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from tests.mcore.megatron_gpt import build_gpt, export, fresh_model, megatron_args, perturb


def indexed(prefixes: list[str], out: str) -> dict:
    """Megatron's IndexedDataset over .bin/.idx pairs: every sequence, the lengths, the document index
    (to ``{out}{i}.npz`` for the i-th prefix); and the documents it read written again by Megatron's
    IndexedDatasetBuilder to ``{out}{i}.bin/.idx`` (as preprocess_data.py adds them: one sequence per
    document, none for an empty one)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    found = []
    for i, prefix in enumerate(prefixes):
        ds = IndexedDataset(prefix)
        seqs = [ds[j] for j in range(len(ds))]
        np.savez(f"{out}{i}.npz", sizes=ds.sequence_lengths, document_indices=ds.document_indices,
                 tokens=np.concatenate(seqs))
        builder = IndexedDatasetBuilder(f"{out}{i}.bin", dtype=ds.index.dtype)
        bounds = ds.document_indices
        for d in range(len(bounds) - 1):
            doc = seqs[bounds[d]:bounds[d + 1]]
            tokens = np.concatenate(doc) if doc else np.zeros(0, ds.index.dtype)
            builder.add_document(torch.from_numpy(tokens), [len(x) for x in doc])
        builder.finalize(f"{out}{i}.idx")
        found.append({"dtype": np.dtype(ds.index.dtype).name, "num_sequences": len(ds)})
    return {"datasets": found}


def gpt_datasets(prefix: str, out: str, cache: str, seq_length: int, split: str, seed: int,
                 sizes: list[int]) -> dict:
    """Megatron's BlendedMegatronDatasetBuilder + GPTDataset over one prefix, as ``--data-path PREFIX
    --split SPLIT`` builds them; each split's indices and every sample's tokens and labels."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    # The dataset reads eod (masks), pad (-1: no pad token, Megatron's default), vocab_size and the
    # identifiers that go into its cache key.
    tokenizer = SimpleNamespace(eod=0, pad=-1, vocab_size=None, unique_identifiers={"class": "oracle"})
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=([prefix], None),
                              split=split, path_to_cache=cache, tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False)
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    arrays, lengths = {}, {}
    for name, ds in zip(("train", "valid", "test"), built, strict=True):
        if ds is None:
            continue
        items = [ds[i] for i in range(len(ds))]
        arrays.update({f"{name}_document_index": ds.document_index, f"{name}_sample_index": ds.sample_index,
                       f"{name}_shuffle_index": ds.shuffle_index,
                       f"{name}_tokens": np.stack([it["tokens"].numpy() for it in items]),
                       f"{name}_labels": np.stack([it["labels"].numpy() for it in items])})
        lengths[name] = len(ds)
    np.savez(out, **arrays)
    return {"lengths": lengths}


def sample_indices(cases: str, out: str) -> dict:
    """Megatron's compiled ``helpers.build_sample_idx`` on each case of the ``cases`` npz (sizes_i,
    order_i, params_i = seq_length, num_epochs, tokens_per_epoch, drop_last_partial, add_extra_token)."""
    from megatron.core.datasets import helpers

    given = np.load(cases)
    n = sum(1 for k in given.files if k.startswith("params_"))
    results, refused = {}, []
    for i in range(n):
        seq, epochs, tokens, drop_last, extra = (int(x) for x in given[f"params_{i}"])
        try:
            results[f"sample_index_{i}"] = helpers.build_sample_idx(
                given[f"sizes_{i}"], given[f"order_{i}"], seq, epochs, tokens, bool(drop_last), bool(extra))
        except AssertionError:  # >= 0.10's range check on its own output (a negative offset)
            refused.append(i)
    np.savez(out, **results)
    return {"cases": n, "refused": refused}


def _cpu_shims() -> None:
    """What a CPU-only torch needs (no edit of Megatron's files): the CUDA RNG tracker's fork, entered
    around attention dropout (0 here), becomes a no-op; ``torch.cuda.current_device()`` names the CPU,
    so the tensors Megatron places there (the attention scratch buffer that baddbmm uses with beta=0,
    dist_checkpointing's save status flags) live on the CPU; ``torch.cuda.synchronize`` (before the
    save's write) does nothing, as there is no device."""
    import contextlib

    import torch
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def _logits(model, ids, hidden_size: int):
    """[b, s] ids -> [b, s, padded vocab] fp32 logits on the last pipeline stage, gathered over its tp
    group (rank order); None on the other stages. Stages hand the hidden states on as Megatron's schedule
    does (``set_input_tensor`` on the receiving stage), with a plain gloo send/recv."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked (get_ltor_masks_and_position_ids)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    with torch.no_grad():
        if not first:
            hidden = torch.empty(s, b, hidden_size, dtype=next(model.parameters()).dtype)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids if first else None, torch.arange(s)[None].expand_as(ids), mask)
    if not last:
        dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None
    # Float16Module's float16_to_fp32 on the last stage: bf16 logits leave the model as fp32.
    logits = out.float().contiguous()  # [b, s, vocab / tp]
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits, group=group)
    return torch.cat(parts, dim=-1)


def _fp32_twin(model, args, tp: int):
    """An fp32 GPTModel holding the low-precision model's weights exactly (upcast): its logits separate
    what the weights are (an exact check) from what bf16/fp16 arithmetic does to them."""
    import torch

    twin = build_gpt(args, tp, torch.float32)
    twin.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in model.state_dict().items()},
                         strict=True)
    return twin.eval()


def _lm_twin(model, args):
    """The same for a Megatron-LM model (Float16Module around it): its own builder with fp32 params."""
    import copy

    import torch

    from tests.mcore import megatron_lm

    fp32 = copy.copy(args)
    fp32.fp16 = fp32.bf16 = False
    fp32.params_dtype = torch.float32
    twin = megatron_lm.provider(fp32)(pre_process=True, post_process=True)
    twin.load_state_dict({k: v.float() if torch.is_tensor(v) else v
                          for k, v in megatron_lm.unwrap(model).state_dict().items()}, strict=True)
    return twin.eval()


def _lm_model(rank: int, world: int, job: dict):
    """Megatron-LM's own path (tests/mcore/megatron_lm.py): parse ``job["argv"]``, build with get_model,
    then ``load_checkpoint`` (``load``: a Slipway checkpoint folder) or ``save_checkpoint`` of its own
    (seeded, biases and norms moved off 0/1) to ``dir``. Returns (model, args)."""
    import torch

    from tests.mcore import megatron_lm

    where = ["--load", job["load"]] if "load" in job else ["--save", job["dir"]]
    args = megatron_lm.parse([*job["argv"], *where], rank, world)
    torch.manual_seed(1234)
    model = megatron_lm.get_model(args)[0]
    if "load" in job:
        iteration = megatron_lm.load([model])
        if rank == 0 and "args_out" in job:
            with open(job["args_out"], "w") as f:
                json.dump({"iteration": iteration, "fields": megatron_lm.fields(args, job["compare"])}, f)
    else:
        perturb(megatron_lm.unwrap(model))
        megatron_lm.save([model], job["iteration"])
    return model, args


def _rank(rank: int, world: int, store: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    tp, pp = job["tp"], job.get("pp", 1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _cpu_shims()
    twin = None
    if "argv" in job:  # Megatron-LM's own parser, model builder and checkpointing
        from tests.mcore import megatron_lm

        megatron_lm.cpu_shims()
        model, args = _lm_model(rank, world, job)
        if args.fp16 or args.bf16:
            twin = lambda: _lm_twin(model, args)  # noqa: E731
        hidden = args.hidden_size
    else:
        if "shard_files" in job:  # in: a checkpoint's shards, loaded as Megatron-LM's load_checkpoint does
            shard = torch.load(job["shard_files"][rank], map_location="cpu", weights_only=False)
            args = shard["args"]
            model = build_gpt(args, tp)
            model.load_state_dict(shard["model"], strict=True)
        elif "dist_dir" in job:  # in: a torch_dist checkpoint, at this tp whatever it was saved at
            model, args = _load_dist(job["dist_dir"], tp)
        else:  # out: Megatron's own weights, saved as Megatron-LM saves them (job["format"])
            args = megatron_args(job)
            export(model := fresh_model(args, tp), args, job, rank)
        if next(model.parameters()).dtype != torch.float32:
            twin = lambda: _fp32_twin(model, args, tp)  # noqa: E731
        hidden = args.hidden_size
    if "out" in job:  # refusal jobs only save
        ids = torch.from_numpy(np.load(job["tokens"]))
        found = {"out": _logits(model.eval(), ids, hidden)}
        if twin is not None:  # pp 1 only
            found["out_fp32"] = _logits(twin(), ids, hidden)
        if found["out"] is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            for key, logits in found.items():
                np.save(job[key] if key in job else job["out"].replace(".npy", "_fp32.npy"), logits.numpy())
    dist.destroy_process_group()


def _load_dist(iter_dir: str, tp: int):
    """GPTModel from a torch_dist checkpoint as Megatron-LM's load_checkpoint reads one: the args from
    common.pt (load_common_state_dict), then ``dist_checkpointing.load`` of the model's own
    ``sharded_state_dict()`` (default strictness: every requested key must be there, extra keys such as
    optimizer state are fine) and ``load_state_dict(strict=True)``.

    argparse.Namespace is registered as a safe global first, as megatron-core 0.16 does on import
    (megatron/core/safe_globals.py): 0.8 and 0.10 call ``torch.load(common.pt)`` without
    ``weights_only``, which torch >= 2.6 defaults to True, so they refuse any checkpoint's Namespace args
    otherwise (0.13 passes weights_only=False). common.pt must load weights-only with nothing else."""
    import argparse

    import torch
    from megatron.core import dist_checkpointing

    torch.serialization.add_safe_globals([argparse.Namespace])
    args = torch.load(f"{iter_dir}/common.pt", map_location="cpu", weights_only=True)["args"]
    model = build_gpt(args, tp)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
    model.load_state_dict(loaded["model"], strict=True)
    return model, args


def model(jobs: list[dict], store: str) -> dict:
    """Each job on ``job["tp"]`` forked gloo ranks (megatron-core is imported once, before the forks):
    ``shard_files`` jobs load a checkpoint into GPTModel, ``dist_dir`` jobs a torch_dist one; ``dir``
    jobs save a fresh GPTModel there (``format``: torch or torch_dist). With ``out``, the logits on
    ``tokens`` (.npy [b, s]) go there (.npy), and for a bf16 model the fp32 twin's to ``out`` with ``_fp32``
    before ``.npy``. ``argv`` jobs run Megatron-LM's own parser, model builder and checkpointing
    (``load``: load_checkpoint of a Slipway run; ``dir``: save_checkpoint; ``pp`` stages). ``common_as_is``:
    how this version's own ``load_common_state_dict`` fares with the first torch_dist checkpoint
    (``dist_dir``, ``common_probe``) before anything is registered ("ok", or its error's first line)."""
    import torch.multiprocessing as mp
    from megatron.core.models.gpt import GPTModel  # noqa: F401 (imported before forking)

    if any("argv" in job for job in jobs):  # Megatron-LM's training side, once before the forks
        from megatron.training import checkpointing, training  # noqa: F401
    _results_queue_once()

    dist = [job.get("dist_dir") or job["common_probe"] for job in jobs
            if {"dist_dir", "common_probe"} & set(job)]
    as_is = _common_as_is(dist[0]) if dist else None  # before the forks register anything
    seconds = []
    for i, job in enumerate(jobs):
        start = time.monotonic()
        world = job["tp"] * job.get("pp", 1)
        mp.start_processes(_rank, args=(world, f"{store}{i}", job), nprocs=world, start_method="fork")
        seconds.append(round(time.monotonic() - start, 2))
    return {"jobs": len(jobs), "seconds": seconds, "common_as_is": as_is}


def _results_queue_once() -> None:
    """dist_checkpointing's torch_dist writer collects its write results through a multiprocessing
    Manager queue (module global ``_results_queue``), which it starts on first use by *spawning* a server
    (a fresh interpreter, which then imports torch to unpickle the first results: 3-5 s on this CPU),
    once per process, so once per forked rank. Here one is started once before the forks, by fork (the
    server is a copy of this process, torch already imported), and every rank inherits it (a proxy
    reconnects after a fork). The queue and what goes through it are the same."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _MANAGER
    if getattr(filesystem_async, "_results_queue", False) is None:
        _MANAGER = multiprocessing.get_context("fork").Manager()
        filesystem_async._results_queue = _MANAGER.Queue()


_MANAGER = None  # the results-queue server this process started (shut down when the worker ends)


def _common_as_is(iter_dir: str) -> str:
    from megatron.core.dist_checkpointing import load_common_state_dict

    try:
        load_common_state_dict(iter_dir)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def data(indexed_args: dict, gpt_args: dict, sample_args: dict) -> dict:
    """The data checks in one process (an interpreter with megatron-core takes ~5 s to start)."""
    return {"indexed": indexed(**indexed_args), "gpt": gpt_datasets(**gpt_args),
            "sample": sample_indices(**sample_args)}


def blends(cases: list[dict]) -> dict:
    """Megatron's BlendedMegatronDatasetBuilder over weighted prefixes (``--data-path W1 P1 W2 P2``), one
    blend per case (``prefixes``, ``weights``, ``sizes`` = train/valid/test samples, ``seq_length``,
    ``seed``, ``split``, ``read``): per split, the (dataset, sample) of every position, each corpus's GPT
    dataset length, and the tokens of the first ``read`` positions."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tokenizer = SimpleNamespace(eod=0, pad=-1, vocab_size=None, unique_identifiers={"class": "oracle"})
    found = []
    for a in cases:
        config = GPTDatasetConfig(random_seed=a["seed"], sequence_length=a["seq_length"],
                                  blend=(a["prefixes"], a["weights"]), split=a["split"], path_to_cache=None,
                                  tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False)
        built = BlendedMegatronDatasetBuilder(GPTDataset, a["sizes"], lambda: True, config).build()
        out = {}
        for i, (name, blend) in enumerate(zip(("train", "valid", "test"), built, strict=True)):
            if blend is None or not a["sizes"][i]:
                continue
            di, si = np.asarray(blend.dataset_index), np.asarray(blend.dataset_sample_index)
            tokens = [blend.datasets[int(d)]._query_document_sample_shuffle_indices(int(s))[0].tolist()
                      for d, s in zip(di[:a["read"]], si[:a["read"]], strict=True)]
            out[name] = {"dataset_index": di.tolist(), "dataset_sample_index": si.tolist(),
                         "lengths": [len(d) for d in blend.datasets], "tokens": tokens}
        found.append(out)
    return {"blends": found}


CHECKS = {"indexed": indexed, "gpt_datasets": gpt_datasets, "data": data, "model": model, "blends": blends}


def main(argv: list[str]) -> int:
    """``NAME JSON_KWARGS``: one check, its result on stdout's last line. ``--serve``: every request line
    of stdin ({"check", "kwargs"}) in turn, each answer on a line that starts with versions.RESULT (an
    exception is answered with its traceback); ends with stdin."""
    import traceback

    import megatron.core

    from tests.mcore.versions import RESULT

    if argv[:1] != ["--serve"]:
        name, kwargs = argv[0], json.loads(argv[1])
        print(json.dumps({"megatron_core": megatron.core.__version__, **CHECKS[name](**kwargs)}))
        return 0
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = {"megatron_core": megatron.core.__version__,
                      **CHECKS[request["check"]](**request["kwargs"])}
        except Exception:  # noqa: BLE001 - the harness reports it with the check's name
            answer = {"error": traceback.format_exc()}
        sys.stdout.write(RESULT + json.dumps(answer) + "\n")
        sys.stdout.flush()
    # The end of the input: every answer is written and every rank joined. Skip the interpreter's own
    # teardown (2-4 s of torch and megatron-core finalizers, per version), stopping the one child left.
    if _MANAGER is not None:
        _MANAGER.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

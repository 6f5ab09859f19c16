"""Parallel machinery that needs no second process: validation, env parsing, the world-of-one engine."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import harness as H
from trainer.config.model import ModelConfig
from trainer.formulas import num_microbatches
from trainer.model import build_gpt, masked_mean
from trainer.parallel import (
    ParallelConfig,
    ParallelState,
    build_model,
    check_layout,
    clip_grad_norm,
    dist_env,
    eval_step,
    train_step,
)
from trainer.parallel.apply import check_compatible
from trainer.parallel.launch import cpu_threads_per_rank, first_host
from trainer.parallel.random import RNGTracker
from trainer.parallel.state import grid_cell


def test_layout_error_names_every_factor():
    assert check_layout(8, 2, 2) == 2
    with pytest.raises(ValueError) as err:
        check_layout(6, 4, 1)
    msg = str(err.value)
    assert "world_size=6" in msg and "tp_size=4" in msg and "pp_size=1" in msg and "dp_size" in msg


def test_config_validation():
    with pytest.raises(ValueError, match="schedule"):
        ParallelConfig(schedule="gpipe")
    with pytest.raises(ValueError, match="tp_size"):
        ParallelConfig(tp_size=0)
    assert num_microbatches(192, 12, 8) == 2
    with pytest.raises(ValueError, match=r"global_batch_size=100 .*micro_batch_size=4 × dp_size=8 \(= 32\)"):
        num_microbatches(100, 4, 8)
    cfg = ModelConfig(num_layers=6, hidden_size=64, num_attention_heads=8, seq_length=10, vocab_size=50)
    with pytest.raises(ValueError, match=r"parallel.pp_size=4: model.num_layers=6 is not divisible by it"):
        check_compatible(cfg, ParallelConfig(pp_size=4))
    with pytest.raises(ValueError, match="seq_length=10 divisible by parallel.tp_size=4"):
        check_compatible(cfg, ParallelConfig(tp_size=4, sequence_parallel=True))
    with pytest.raises(ValueError, match="tp=2"):
        build_model(H.CFG, ParallelConfig(tp_size=2), ParallelState.single(), 0)


def test_dist_env_from_torchrun_slurm_or_nothing():
    env = dist_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
                    "MASTER_PORT": "7"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == \
        (3, 8, 1, "n1", 7, "torchrun")
    env = dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
                    "SLURM_JOB_NODELIST": "gpu[07-08,10],login1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 1, "gpu07")
    assert env.master_port == 20000 + 4242
    assert dist_env({}).world_size == 1 and dist_env({}).source == "single"
    assert first_host("node1") == "node1"
    assert first_host("a[3-4],b[1-2]") == "a3"
    assert first_host("rack[2-3]-n[05,9]") == "rack2-n05"


def test_cpu_threads_shared_by_the_ranks_of_a_node():
    import os

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_per_rank(4, {}) == max(1, cores // 4)  # 4 ranks on this machine's cores
    assert cpu_threads_per_rank(1, {}) is None  # one rank: torch's default
    assert cpu_threads_per_rank(4, {"OMP_NUM_THREADS": "3"}) is None  # the user's choice wins
    assert cpu_threads_per_rank(8, {"SLURM_CPUS_PER_TASK": "6"}) == 6  # Slurm bound the task already
    assert cpu_threads_per_rank(1, {"SLURM_CPUS_PER_TASK": "1"}) == 1  # alone on a node others share


def test_world_of_one_step_equals_plain_model_math():
    """train_step's loss and gradients = mean over micro-batches of masked means, by hand."""
    model = build_model(H.CFG, ParallelConfig(), ParallelState.single(), H.SEED)
    batches = H.microbatches(0, 0, 1)
    loss = train_step(model, batches)
    plain = build_gpt(H.CFG, H.SEED)
    ref = sum(masked_mean(plain(tokens=b["tokens"], labels=b["labels"]), b["loss_mask"]) for b in batches)
    (ref / len(batches)).backward()
    torch.testing.assert_close(loss, ref.detach() / len(batches))
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-8)
    total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    norm = clip_grad_norm(model, 0.5)
    assert abs(norm - total.item()) < 1e-5 * total.item()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-8)  # clipped alike
    with torch.no_grad():
        ev = sum(masked_mean(plain(tokens=b["tokens"], labels=b["labels"]), b["loss_mask"]) for b in batches)
    torch.testing.assert_close(eval_step(model, batches), ev / len(batches))


def test_grad_buffers_survive_set_to_none():
    model = build_model(H.CFG, ParallelConfig(), ParallelState.single(), 0)
    batches = H.microbatches(0, 0, 1)[:1]
    train_step(model, batches)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None  # what optimizer.zero_grad() does by default
    train_step(model, batches)
    bucket_ptrs = {v.data_ptr() for b in model.grads.buckets for v in b.views}
    for name, p in model.named_parameters():
        assert p.grad.data_ptr() in bucket_ptrs
        torch.testing.assert_close(p.grad, first[name])


def test_rng_tracker_fork_is_separate_and_advances():
    tracker = RNGTracker("cpu")
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(1)
    with tracker.fork():
        a = torch.rand(4)
    outside = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(outside, torch.rand(4))  # the fork did not disturb the default stream
    assert not torch.equal(a, b)                 # the forked stream advanced
    g = torch.Generator().manual_seed(7)
    assert torch.equal(a, torch.rand(4, generator=g))


def test_rank_grid_is_tp_fastest_then_dp_then_pp():
    world = [0, 1, 2, 3]
    cell = grid_cell(world, 2, 2, 3)
    assert (cell.tp_rank, cell.pp_rank, cell.dp_rank) == (1, 1, 0)
    assert (cell.tp_ranks, cell.pp_ranks, cell.dp_ranks) == ((2, 3), (1, 3), (3,))
    assert cell.embedding_ranks == (1, 3)
    cell = grid_cell(world, 2, 1, 2)
    assert (cell.tp_ranks, cell.dp_ranks, cell.pp_ranks, cell.dp_rank) == ((2, 3), (0, 2), (2,), 1)
    assert grid_cell(world, 1, 2, 1).dp_ranks == (0, 1) and grid_cell(world, 1, 2, 1).pp_ranks == (1, 3)
    assert grid_cell(world, 1, 4, 0).embedding_ranks == (0, 3)
    assert grid_cell(world, 1, 4, 1).embedding_ranks == (1,)  # middle stages hold no embedding
    # A sub-world (as the tests use): positions index into the given ranks.
    assert grid_cell([4, 5, 6, 7, 8, 9, 10, 11], 2, 2, 9).tp_ranks == (8, 9)
    assert grid_cell(list(range(16)), 2, 4, 13).pp_ranks == (1, 5, 9, 13)
    with pytest.raises(ValueError, match="not in the layout"):
        grid_cell([0, 1], 1, 1, 5)


def test_mixed_precision_autocast_and_low_precision_params():
    batches = H.microbatches(0, 0, 1)[:2]
    fp32 = build_model(H.CFG, ParallelConfig(), ParallelState.single(), H.SEED)
    ref = train_step(fp32, batches)
    fp32.autocast = torch.bfloat16
    mixed = train_step(fp32, batches)
    assert mixed.dtype == torch.float32 and abs(mixed.item() - ref.item()) < 2e-2
    assert all(p.grad.dtype == torch.float32 for p in fp32.parameters())
    bf16 = build_model(H.CFG, ParallelConfig(), ParallelState.single(), H.SEED, dtype=torch.bfloat16)
    low = train_step(bf16, batches)
    assert abs(low.item() - ref.item()) < 5e-2
    assert all(p.dtype == p.grad.dtype == torch.bfloat16 for p in bf16.parameters())

"""Weighted blends (``data.paths=[0.2,A,0.5,B,0.3,C]``) against real megatron-core, and resume mid-blend.

The oracle is megatron-core's own ``BlendedMegatronDatasetBuilder`` (``blends`` in
``tests/mcore/checks.py``, run under each version of the ``make mcore`` matrix) building the blend of the
same ``.bin/.idx`` prefixes that Slipway writes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.data.test_gpt_dataset_indexed import write_pair
from tests.mcore.harness import run_check
from trainer.config import DataConfig, TrainConfig
from trainer.config_issues import deferred
from trainer.data.blend import BlendError, parse_blend
from trainer.data.blended_dataset import BlendRequest, build_blended_datasets
from trainer.data.gpt_dataset import GPTDatasetConfig
from trainer.data.indexed_dataset import IndexedDataset
from trainer.parallel import ParallelState
from trainer.restore.state import TrainState
from trainer.run.data import DataShape, build_data

SEQ, SEED, SPLIT = 16, 1234, "90,10,0"
WEIGHTS = [2.0, 5.0, 3.0]  # normalised by both sides
TRAIN, VALID = 300, 40


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    """Three corpora of different sizes: the 5-weight one is the smallest, so it runs several epochs."""
    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(7)
    prefixes = []
    for k, docs in enumerate((40, 25, 70)):
        lengths = rng.integers(0, 100, docs)
        prefix = str(root / f"corpus{k}_text_document")
        write_pair(prefix, [rng.integers(0, 60_000, n).astype(np.uint16) for n in lengths])
        prefixes.append(prefix)
    return prefixes


def slipway_blend(prefixes: list[str], cache_dir: str, weights: list[float] = WEIGHTS,
                  sizes: tuple[int, int] = (TRAIN, VALID)):
    request = BlendRequest([IndexedDataset(p) for p in prefixes], prefixes, parse_blend(
        [x for w, p in zip(weights, prefixes, strict=True) for x in (str(w), p)]).normalized)
    config = GPTDatasetConfig(seq_length=SEQ, seed=SEED, split=SPLIT, cache_dir=cache_dir)
    return build_blended_datasets(request, dict(zip(("train", "valid"), sizes, strict=True)), config,
                                  is_builder=True)


def cases(corpora: list[str]) -> list[tuple[list[str], list[float], tuple[int, int]]]:
    """(prefixes, weights, (train, valid) samples): three corpora, the smallest with the largest weight
    (it runs 3 epochs); Megatron's own 0.3/0.7 spelling at 1000 samples; one weighted corpus (a blend of
    one, which Megatron sizes with the margin unlike a plain path)."""
    return [(corpora, WEIGHTS, (TRAIN, VALID)), ([corpora[0], corpora[2]], [0.3, 0.7], (1000, 30)),
            ([corpora[1]], [1.0], (200, 20))]


def test_blend_order_and_samples_equal_megatron_core(mcore_version, corpora, tmp_path):
    version, todo = mcore_version, cases(corpora)
    theirs = run_check(version, "blends", timeout=600, cases=[
        {"prefixes": p, "weights": w, "sizes": [*n, 0], "seq_length": SEQ, "seed": SEED, "split": SPLIT,
         "read": n[0]} for p, w, n in todo])
    newer = tuple(int(x) for x in version.split(".")) >= (0, 13)  # today's sizing rule, which Slipway follows
    for case, ((prefixes, weights, sizes), mc_case) in enumerate(zip(todo, theirs["blends"], strict=True)):
        ours = slipway_blend(prefixes, str(tmp_path / f"cache{case}"), weights, sizes)
        for name, wanted in zip(("train", "valid"), sizes, strict=True):
            blend, mc = ours[name], mc_case[name]
            # megatron-core 0.8.0-0.10.0 draw ceil(N * w * 1.005) per corpus, later ones ceil(N * w): the
            # common positions (at least the N the trainer reads) must be the same (corpus, sample).
            common = min(len(blend), len(mc["dataset_index"]))
            assert common >= wanted and (len(blend) == len(mc["dataset_index"]) or not newer), case
            np.testing.assert_array_equal(blend.dataset_index[:common], mc["dataset_index"][:common])
            np.testing.assert_array_equal(blend.dataset_sample_index[:common],
                                          mc["dataset_sample_index"][:common])
            assert [len(d) for d in blend.datasets] == mc["lengths"], (case, name)
        for i, tokens in enumerate(mc_case["train"]["tokens"]):
            np.testing.assert_array_equal(ours["train"][i], tokens, err_msg=f"case {case} train position {i}")
        if case == 0:
            counts = np.bincount(ours["train"].dataset_index[:TRAIN], minlength=3)
            assert counts.tolist() == [60, 150, 90]  # the weights, exactly at this N
            assert ours["train"].datasets[1].num_epochs == 3  # ...and corpus 1's share takes 3 epochs of it


def test_resume_mid_blend_reads_the_uninterrupted_sequence(corpora, tmp_path):
    """A restart at consumed_train_samples (what a checkpoint holds) continues the same sample sequence,
    through the trainer's own data set-up (data.paths as weight/prefix pairs)."""
    data = DataConfig(paths=[x for w, p in zip(WEIGHTS, corpora, strict=True) for x in (str(w), p)],
                      split=SPLIT, cache_dir=str(tmp_path / "cache"))
    train = TrainConfig(iters=TRAIN // 6, micro_batch_size=3, global_batch_size=6, seed=SEED,
                        eval_interval=10, eval_iters=1)
    shape = DataShape(seq_length=SEQ, global_batch_size=6, run_dir=str(tmp_path / "run"))
    ps = ParallelState.single()
    unbroken, _ = build_data(data, train, shape, ps, TrainState())
    micro = [next(unbroken)["tokens"] for _ in range(40)]  # micro-batches of 3: two per step of 6
    resumed, _ = build_data(data, train, shape, ps, TrainState(iteration=7, consumed_train_samples=7 * 6))
    for m in range(14, 40):
        np.testing.assert_array_equal(next(resumed)["tokens"].numpy(), micro[m].numpy(), f"micro-batch {m}")
    # The blend really mixes: these steps read more than one corpus.
    blend = slipway_blend(corpora, str(tmp_path / "cache"))["train"]
    assert len({int(c) for c in blend.dataset_index[42:120]}) == 3


@pytest.mark.parametrize(("paths", "why"), [
    (["0.3", "a", "b"], "out of order at entry 2 ('b')"),
    (["0.3", "a", "0", "b"], "entry 2, the weight 0 of 'b', is not a finite number > 0"),
    (["0.3", "a", "0.7"], "the weight '0.7' has no path"),
])
def test_a_broken_blend_names_the_entry(paths, why):
    with pytest.raises(BlendError, match=re.escape(why)):
        parse_blend(paths)
    with deferred():
        cfg = DataConfig(paths=paths)
    assert [(i.code, i.key) for i in cfg.problems()] == [("blend", "data.paths")]

"""A job submitted before the stages became modules is requeued after an upgrade: submitit unpickles its
callable and job spec by the names they had then (orchestrator.stages.TrainStage, orchestrator.jobs.*).
Those names must still resolve, to classes with the same fields."""

from __future__ import annotations

import pickle

from orchestrator.stages.convert import ConvertJob, ConvertStage
from orchestrator.stages.corpus import CorpusStage
from orchestrator.stages.train import TrainJob, TrainStage
from orchestrator.stages.upstream import Upstream
from trainer.config import CorpusConfig
from trainer.convert.run_config import ConvertRunConfig
from trainer.data.corpus_config import CorpusRun

# Where each class lives now → where a pickle written by f24446f names it (GLOBAL opcodes of protocol 2).
OLD_NAMES = [
    (b"orchestrator.stages.train\nTrainStage", b"orchestrator.stages\nTrainStage"),
    (b"orchestrator.stages.corpus\nCorpusStage", b"orchestrator.stages\nCorpusStage"),
    (b"orchestrator.stages.convert\nConvertStage", b"orchestrator.stages\nConvertStage"),
    (b"orchestrator.stages.train\nTrainJob", b"orchestrator.jobs\nTrainJob"),
    (b"orchestrator.stages.convert\nConvertJob", b"orchestrator.jobs\nConvertJob"),
    (b"trainer.data.corpus_config\nCorpusRun", b"orchestrator.jobs\nCorpusJob"),
    (b"orchestrator.stages.upstream\nUpstream", b"orchestrator.jobs\nUpstream"),
]
# Upstream lived in orchestrator.stages.base from f24446f until the upstream wait got its own module.
BASE_UPSTREAM = (b"orchestrator.stages.upstream\nUpstream", b"orchestrator.stages.base\nUpstream")


def as_written_before(obj: object) -> bytes:
    blob = pickle.dumps(obj, protocol=2)
    for new, old in OLD_NAMES:
        blob = blob.replace(new, old)
    return blob


def test_old_stage_pickles_load():
    up = [Upstream("/cache/preprocess/k", "12", "slurm")]
    callables = [
        TrainStage(TrainJob("/runs/r", {"train": {"iters": 2}}, ["/s.json"]), "/runs/r/train", up, "t"),
        CorpusStage(CorpusRun("/cache/corpus/k", CorpusConfig(), 300, "content"), "/cache/corpus/k", [], "c"),
        ConvertStage(ConvertJob("/runs/r", ConvertRunConfig(output_dir="/runs/r/hf")), "/runs/r/cv", up, "v"),
    ]
    for fn in callables:
        blob = as_written_before(fn)
        assert not any(new in blob for new, _ in OLD_NAMES)  # only the old names
        loaded = pickle.loads(blob)
        assert type(loaded) is type(fn) and vars(loaded).keys() == vars(fn).keys()
        assert type(loaded.job) is type(fn.job) and vars(loaded.job) == vars(fn.job)
        assert loaded.upstream == fn.upstream


def test_upstreams_pickled_while_they_lived_in_the_stage_base_load():
    up = [Upstream("/cache/preprocess/k", "12", "slurm", after_any=True)]
    blob = pickle.dumps(TrainStage(TrainJob("/runs/r", {}, []), "/runs/r/train", up, "t"), protocol=2)
    old = blob.replace(*BASE_UPSTREAM)
    assert old != blob and BASE_UPSTREAM[0] not in old
    assert pickle.loads(old).upstream == up

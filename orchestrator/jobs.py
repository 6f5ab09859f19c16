"""Pickle names only. Runs submitted before each stage became a module of orchestrator/stages/ pickled their
job specs under this module's name; a requeued job of such a run unpickles them from here. New code
imports them from their stage's module."""

from orchestrator.stages.convert import ConvertJob
from orchestrator.stages.train import TrainJob
from orchestrator.stages.upstream import Upstream
from trainer.data.corpus_config import CorpusRun as CorpusJob

__all__ = ["ConvertJob", "CorpusJob", "TrainJob", "Upstream"]

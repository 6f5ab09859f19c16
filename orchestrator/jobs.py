"""What each stage is asked to do: the small picklable job specs, and the markers a stage leaves behind.

The plan (pure) builds these specs; submit pickles them into the stage callables of
:mod:`orchestrator.stages`, which run on the nodes. This module imports neither submitit nor the trainer,
so planning and the status table never load them.

Every stage writes ``run_files.COMPLETE`` into its output directory when it succeeded and
``run_files.FAILED`` when it raised, so later launches can reuse complete outputs and local jobs (which
have no Slurm ``afterok``) can wait on their upstream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from trainer.config import CorpusConfig
from trainer.convert.run_config import ConvertRunConfig


@dataclass(frozen=True)
class Upstream:
    """A stage this one needs: its output dir and, for local jobs, the controller's pid."""

    output_dir: str
    job_id: str | None = None
    executor: str = "slurm"


@dataclass
class CorpusJob:
    output_dir: str
    corpus: CorpusConfig  # the data.corpus section itself (trainer/config)
    vocab_size: int | None  # train a BPE of this size on the corpus when set
    json_key: str


@dataclass
class PreprocessJob:
    output_dir: str
    inputs: list[str]
    vocab_file: str | None
    merge_file: str | None
    # The data section's values (trainer/config DataConfig and trainer/data/preprocess.py hold the defaults).
    json_key: str
    append_eod: bool
    workers: int
    progress: str  # "log" or "bar": a tqdm bar in the job's log (a local run streams it to the terminal)
    on_error: str  # bad JSONL lines: fail (name file:line) or skip (count them in the summary)
    tokenizer_type: str
    tokenizer_model: str | None = None  # HuggingFaceTokenizer: the tokenizer.json directory

    @property
    def prefixes(self) -> list[str]:
        """One output prefix per input (``data``, or ``data0``, ``data1``... for several inputs)."""
        if len(self.inputs) == 1:
            return [os.path.join(self.output_dir, "data")]
        return [os.path.join(self.output_dir, f"data{i}") for i in range(len(self.inputs))]


@dataclass
class TrainJob:
    run_dir: str
    trainer_config: dict[str, Any]
    data_summaries: list[str] = field(default_factory=list)  # preprocessing summaries → data_report.json


@dataclass
class ConvertJob:
    run_dir: str
    config: ConvertRunConfig  # the hook's own config (trainer/convert/run_config.py), built by the plan

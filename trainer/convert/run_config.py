"""What the post-job conversion does (:func:`trainer.convert.convert_run`): torch-free, so the launcher's
plan builds it as the convert stage's job and the stage hands it to the hook unchanged (one set of
defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConvertRunConfig:
    """What the post-job conversion does. Paths default to the run directory's standard layout."""

    checkpoint_dir: str | None = None  # default <run_dir>/checkpoints
    output_dir: str | None = None  # default <run_dir>/hf
    vocab_file: str | None = None  # the run's tokenizer; default: the paths in the checkpoint's args
    merge_file: str | None = None
    tokenizer_model: str | None = None  # a HuggingFaceTokenizer directory; default: the checkpoint's args
    iteration: int | None = None  # default: the latest committed one
    verify: bool = True  # verification always runs (it is part of conversion); False only logs a warning
    prompt: str = "def fibonacci("  # what the sample continues (greedy), written to <run_dir>/sample.txt
    sample_tokens: int = 64
    repetition_penalty: float = 1.3  # >1 keeps a small model's greedy sample out of loops (1.0: plain greedy)
    val_loss: float | None = None  # for the model card; default: the last one in train_metrics.jsonl
    write_bin: bool = False
    push_to_hub: bool = False
    hub_repo: str | None = None  # "user/name" on the Hub
    hub_private: bool = True

    def __post_init__(self) -> None:
        if self.sample_tokens < 1:
            raise ValueError(f"sample_tokens={self.sample_tokens} must be ≥ 1")
        if self.push_to_hub and not self.hub_repo:
            raise ValueError("push_to_hub=true needs hub_repo ('user/model-name')")

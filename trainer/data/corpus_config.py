"""The ``data.corpus`` section (torch-free): what the corpus stage builds, and the stage's job spec
(:class:`CorpusRun`). They live beside the corpus builder that reads them (trainer/data/corpus.py);
trainer.config puts the section in the data section."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config_issues import ConfigIssue, Section, choice, positive


@dataclass
class CorpusConfig(Section):
    """Optional corpus stage: build a JSONL corpus on the cluster instead of reading ``data.paths``."""

    source: str = "stdlib"
    """stdlib: the standard library of the interpreter that runs the job (when roots is empty)."""
    roots: list[str] = field(default_factory=list)
    """Folders searched for *.py files instead of the standard library."""
    max_files: int | None = None
    """Stop after this many files; null: every file."""
    max_bytes: int | None = None
    """Stop before the text exceeds this many bytes; null: no limit."""
    exclude_tests: bool = False
    """Skip folders named test, tests, idle_test and unittests."""

    def problems(self) -> list[ConfigIssue]:
        return (choice("data.corpus.source", self.source, ("stdlib",))
                + positive("data.corpus.max_files", self.max_files, allow_none=True)
                + positive("data.corpus.max_bytes", self.max_bytes, allow_none=True))


@dataclass
class CorpusRun:
    """One corpus stage's work (:func:`trainer.data.corpus.run_corpus`): the corpus into ``output_dir``
    and, when ``vocab_size`` is set, a byte-level BPE of that size trained on it beside it. The plan builds
    it; the field names are those of the job spec older runs pickled, so their requeues still load."""

    output_dir: str
    corpus: CorpusConfig
    vocab_size: int | None  # train a BPE of this size on the corpus when set
    json_key: str  # the JSON field the corpus's text goes in


"""A run with tokenizer.type=HuggingFaceTokenizer: preprocess, train (real loop), convert; hf/ carries the
tokenizer so that ``AutoTokenizer.from_pretrained(hf_dir)`` encodes exactly as the run's own directory."""

from __future__ import annotations

import json

import pytest

from tests.convert.conftest import make_checkpoint
from tests.data.hf_fixtures import HFOracle, build_tokenizer_dir
from tests.train.harness import run_cfg, spawn, tiny_config
from trainer.config import CorpusConfig
from trainer.convert import convert_run
from trainer.convert.shard_io import CheckpointError
from trainer.data.corpus import iter_documents
from trainer.data.preprocess import PreprocessConfig, preprocess
from trainer.formulas import padded_vocab_size


@pytest.fixture(scope="module")
def texts():
    return [d["content"] for d in iter_documents(CorpusConfig(exclude_tests=True, max_bytes=400_000))]


def _train(rank: int, cfg: dict) -> None:
    assert run_cfg(cfg).exit_code == 0


def test_trained_run_hf_folder_encodes_identically(tmp_path, texts):
    model_dir = build_tokenizer_dir(texts[::2], tmp_path / "tok", 1000, add_bos=True, eos_token="<|eos|>")
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    summary = preprocess(PreprocessConfig(
        str(jsonl), str(tmp_path / "data" / "ds"), json_keys=["content"], append_eod=True, workers=1,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(model_dir), progress="none"))
    cfg = tiny_config(str(tmp_path / "run"), summary.outputs["content"],
                      train={"micro_batch_size": 1, "global_batch_size": 2, "iters": 2,
                             "eval_interval": None},
                      tokenizer={"type": "HuggingFaceTokenizer", "model": str(model_dir)})
    cfg["model"].pop("vocab_size")  # from the tokenizer: len(tokenizer), padded as for GPT-2
    spawn(1, str(tmp_path), _train, cfg)
    result = convert_run(tmp_path / "run", sample_tokens=4)
    source, hf_dir = HFOracle(model_dir), tmp_path / "run" / "hf"
    copied = HFOracle(hf_dir)
    assert (copied.vocab_size, copied.eod) == (source.vocab_size, source.eod) == (summary.vocab_size,
                                                                                  summary.eod_id)
    for text in [*texts[1::7], "x <|eos|> y <s>", ""]:
        assert copied.encode(text) == source.encode(text)
    assert result.report.passed
    padded = padded_vocab_size(source.vocab_size, 1)
    assert (result.spec.vocab_size, result.spec.padded_vocab_size) == (source.vocab_size, padded)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == source.vocab_size and config["eos_token_id"] == source.eod
    assert config["model_type"] == "gpt2"  # the model's config.json, not the tokenizer's


def test_convert_errors_name_the_tokenizer(tmp_path, texts):
    from trainer.convert.to_hf import ToHFConfig, convert_checkpoint

    no_eos = build_tokenizer_dir(texts[:40], tmp_path / "no_eos", 1000, eos=False)
    ckpt, _, _ = make_checkpoint(tmp_path, tmp_path, 1, 1, tokenizer_type="HuggingFaceTokenizer",
                                 tokenizer_model=str(no_eos), vocab_file=None, merge_file=None)
    with pytest.raises(CheckpointError, match=r"no_eos: the tokenizer has no eos token.*--tokenizer-model"):
        convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty has no tokenizer.json.*save_pretrained"):
        convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf", tokenizer_model=tmp_path / "empty",
                                      overwrite=True))

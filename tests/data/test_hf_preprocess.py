"""Preprocess with --tokenizer-type HuggingFaceTokenizer: byte-identical to Megatron's preprocess_data.py.

The reference is the transcription of Megatron's pipeline in test_preprocess.py, fed by
:class:`tests.data.hf_fixtures.HFOracle` (what Megatron's ``_HuggingFaceTokenizer`` calls), on a tokenizer
trained here on Python stdlib source and on the same source as text.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.data.hf_fixtures import BOS, EOS, HFOracle, build_tokenizer_dir
from tests.data.test_preprocess import megatron_preprocess, same_bytes, tricky_docs
from trainer.config import CorpusConfig
from trainer.data.corpus import iter_documents
from trainer.data.hf_tokenizer import content_hash
from trainer.data.indexed_dataset import IndexedDataset
from trainer.data.preprocess import PreprocessConfig, preprocess
from trainer.data.tokenizer import TokenizerFileError


@pytest.fixture(scope="module")
def stdlib_docs():
    return list(iter_documents(CorpusConfig(exclude_tests=True, max_bytes=1_500_000)))


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "bos"])
def hf_dir(request, tmp_path_factory, stdlib_docs):
    folder = tmp_path_factory.mktemp("hftok")
    return build_tokenizer_dir([d["content"] for d in stdlib_docs[::2]], folder, add_bos=request.param)


def hf_config(tmp_path, model_dir, **kw) -> PreprocessConfig:
    kw.setdefault("output_prefix", str(tmp_path / "out" / "ds"))
    kw.setdefault("progress", "none")
    return PreprocessConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(model_dir), **kw)


@pytest.mark.parametrize("workers, append_eod", [(1, True), (2, True), (2, False)])
def test_byte_identical_to_megatron(tmp_path, hf_dir, stdlib_docs, workers, append_eod):
    docs = tricky_docs(stdlib_docs)
    docs.insert(5, {"content": f"x {BOS} y {EOS}", "path": EOS})  # special-token strings are parsed
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    keys = ["content", "path"]
    summary = preprocess(hf_config(tmp_path, hf_dir, input=str(jsonl), json_keys=keys, append_eod=append_eod,
                                   workers=workers, chunk_bytes=4096))
    oracle = HFOracle(hf_dir)
    megatron_preprocess(jsonl, tmp_path / "ref", keys, append_eod, oracle.encode, oracle.eod,
                        oracle.vocab_size)
    same_bytes(tmp_path / "out" / "ds", tmp_path / "ref", keys)
    assert (summary.vocab_size, summary.eod_id, summary.dtype) == (oracle.vocab_size, oracle.eod, "uint16")
    first = next(IndexedDataset(summary.outputs["content"]).documents())
    assert (first[0] == oracle.t.convert_tokens_to_ids(BOS)) == (oracle.t("").input_ids != [])
    assert (first[-1] == oracle.eod) == append_eod


def test_changed_tokenizer_changes_content_hash(tmp_path, hf_dir):
    import shutil

    copy = shutil.copytree(hf_dir, tmp_path / "copy")
    assert content_hash(copy) == content_hash(hf_dir)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": BOS}))
    assert content_hash(copy) != content_hash(hf_dir)


def test_missing_tokenizer_json_and_eos(tmp_path, stdlib_docs):
    (tmp_path / "in.jsonl").write_text('{"text": "x = 1"}\n')
    (tmp_path / "empty").mkdir()
    for folder, what in [(tmp_path / "empty", "has no tokenizer.json"), (tmp_path / "nope", "is not a dir")]:
        with pytest.raises(TokenizerFileError, match=f"{folder} {what}.*save_pretrained.*--tokenizer-model"):
            preprocess(hf_config(tmp_path, folder, input=str(tmp_path / "in.jsonl"), workers=1))
    texts = [d["content"] for d in stdlib_docs[:50]]
    no_eos = build_tokenizer_dir(texts, tmp_path / "no_eos", 400, eos=False)
    with pytest.raises(TokenizerFileError, match=r"no_eos: the tokenizer has no eos token.*eos_token_id.*"
                                                 r'Set "eos_token" in its tokenizer_config.json'):
        preprocess(hf_config(tmp_path, no_eos, input=str(tmp_path / "in.jsonl"), workers=1))
    with pytest.raises(ValueError, match="needs tokenizer_model"):
        PreprocessConfig(input="x", output_prefix="y", tokenizer_type="HuggingFaceTokenizer")
    assert not (tmp_path / "out").exists()


def test_cli(tmp_path, hf_dir):
    (tmp_path / "in.jsonl").write_text('{"text": "def f(x):\\n    return x"}\n{"text": ""}\n')
    prefix = str(tmp_path / "cli")
    args = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir), "--append-eod", "--workers", "1"]
    done = subprocess.run([sys.executable, "-m", "trainer.data.preprocess", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    oracle = HFOracle(hf_dir)
    docs = [list(d) for d in IndexedDataset(f"{prefix}_text_document").documents()]
    assert docs[0] == [*oracle.encode("def f(x):\n    return x"), oracle.eod]
    done = subprocess.run([sys.executable, "-m", "trainer.data.preprocess", *args[:-5], "--tokenizer-model",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "has no tokenizer.json" in done.stderr

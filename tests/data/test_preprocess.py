"""Preprocess: byte-identical to Megatron's preprocess_data.py, and bad input never costs data silently.

The reference below is Megatron-LM's tools/preprocess_data.py (current: Encoder.encode, the builder's
add_document and _IndexWriter.write) transcribed line by line, run with GPT-2's own Python BPE (the oracle
of test_tokenizer.py) or with HF tokenizers on larger inputs.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.ci import skip_unless_ci
from tests.data.oracles import GPT2Oracle
from tests.waits import NEVER_S
from trainer.config import CorpusConfig
from trainer.data.corpus import iter_documents
from trainer.data.indexed_dataset import IndexedDataset
from trainer.data.preprocess import EmptyDatasetError, PreprocessConfig, PreprocessError, preprocess
from trainer.data.preprocess_io import InputError
from trainer.data.tokenizer import EOD_TOKEN, load_gpt2_bpe
from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer


def megatron_preprocess(input_path, prefix, keys, append_eod, encode, eod, vocab_size) -> None:
    """Megatron-LM preprocess_data.py without sentence splitting, transcribed."""
    dtype = np.uint16 if vocab_size < 65500 else np.int32  # __best_fitting_dtype
    files = {k: open(f"{prefix}_{k}_document.bin", "wb") for k in keys}
    seq_lens = {k: [] for k in keys}
    doc_idx = {k: [0] for k in keys}
    with open(input_path, encoding="utf-8") as fin:
        for json_line in fin:
            data = json.loads(json_line)
            for key in keys:
                text = data[key]
                sentences = text if isinstance(text, list) else [text]
                doc_ids, sentence_lens = [], []
                for sentence in sentences:
                    sentence_ids = encode(sentence)
                    if len(sentence_ids) > 0:
                        doc_ids.extend(sentence_ids)
                        sentence_lens.append(len(sentence_ids))
                if len(doc_ids) > 0 and append_eod:
                    doc_ids.append(eod)
                    sentence_lens[-1] += 1
                files[key].write(np.array(doc_ids, dtype=dtype).tobytes(order="C"))  # add_document
                seq_lens[key].extend(sentence_lens)
                doc_idx[key].append(len(seq_lens[key]))
    for key in keys:
        files[key].close()
        lengths, pointers, cur = seq_lens[key], [], 0
        for n in lengths:
            pointers.append(cur)
            cur += n * np.dtype(dtype).itemsize
        with open(f"{prefix}_{key}_document.idx", "wb") as f:  # _IndexWriter
            code = 8 if dtype == np.uint16 else 4
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx[key])))
            f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
            f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
            f.write(np.array(doc_idx[key], dtype=np.int64).tobytes(order="C"))


def same_bytes(prefix_a, prefix_b, keys) -> None:
    for key in keys:
        for ext in ("bin", "idx"):
            a = open(f"{prefix_a}_{key}_document.{ext}", "rb").read()
            b = open(f"{prefix_b}_{key}_document.{ext}", "rb").read()
            assert a == b, f"{key} .{ext} differs ({len(a)} vs {len(b)} bytes)"


@pytest.fixture(scope="module")
def stdlib_docs():
    return list(iter_documents(CorpusConfig(exclude_tests=True, max_bytes=3_000_000)))


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory, stdlib_docs):
    folder = tmp_path_factory.mktemp("tok")
    corpus = folder / "train.jsonl"
    corpus.write_text("".join(json.dumps({"content": d["content"]}) + "\n" for d in stdlib_docs[::2]))
    return train_tokenizer(TokenizerTrainConfig([str(corpus)], str(folder / "out"), vocab_size=4000))


def config(tmp_path, tok_files, **kw) -> PreprocessConfig:
    kw.setdefault("output_prefix", str(tmp_path / "out" / "ds"))
    kw.setdefault("progress", "none")
    return PreprocessConfig(vocab_file=str(tok_files[0]), merge_file=str(tok_files[1]), **kw)


def tricky_docs(stdlib_docs):
    docs = [{"content": d["content"][:1500], "path": d["path"]} for d in stdlib_docs[1:120:3]]
    extras = ["", " ", "\n\n", f"a {EOD_TOKEN} b{EOD_TOKEN}", "日本語 🎉 café مرحبا\t\t x  ", "it's\r\nDON'T"]
    for i, text in enumerate(extras):
        docs.insert(3 * i + 1, {"content": text, "path": ""})  # "" path: an empty document in key "path"
    return docs


@pytest.mark.parametrize("workers, append_eod, backend", [(1, True, "auto"), (2, True, "auto"),
                                                         (2, False, "auto"), (2, True, "hf")])
def test_byte_identical_to_megatron(tmp_path, tok_files, stdlib_docs, workers, append_eod, backend):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in tricky_docs(stdlib_docs)),
                     encoding="utf-8")
    keys = ["content", "path"]
    summary = preprocess(config(tmp_path, tok_files, input=str(jsonl), json_keys=keys, append_eod=append_eod,
                                workers=workers, chunk_bytes=4096, backend=backend))
    oracle = GPT2Oracle(*tok_files)
    megatron_preprocess(jsonl, tmp_path / "ref", keys, append_eod, oracle.encode, 0, 4000)
    same_bytes(tmp_path / "out" / "ds", tmp_path / "ref", keys)
    assert summary.backend == ("hf" if backend == "hf" else "tiktoken")
    assert summary.dtype == "uint16" and summary.skipped == {}
    ds = IndexedDataset(summary.outputs["content"])
    assert ds.num_documents == summary.documents == len(tricky_docs(stdlib_docs))
    assert ds.num_documents > len(ds)  # the empty documents are zero-sequence documents


def test_stdlib_round_trip_gz_and_glob(tmp_path, tok_files, stdlib_docs):
    lines = [json.dumps({"content": d["content"]}) + "\n" for d in stdlib_docs]
    half = len(lines) // 2
    with gzip.open(tmp_path / "part-0.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(lines[:half])
    (tmp_path / "part-1.json").write_text("".join(lines[half:]))
    summary = preprocess(config(tmp_path, tok_files, input=str(tmp_path / "part-*"), json_keys=["content"],
                                append_eod=True, workers=2))
    assert summary.inputs == [str(tmp_path / "part-0.jsonl.gz"), str(tmp_path / "part-1.json")]
    tok = load_gpt2_bpe(*tok_files)
    ds = IndexedDataset(summary.outputs["content"])
    for doc, ids in zip(stdlib_docs, ds.documents(), strict=True):
        assert ids[-1] == tok.eod_id and tok.decode(ids[:-1]) == doc["content"]
    (tmp_path / "all.jsonl").write_text("".join(lines))
    hf = load_gpt2_bpe(*tok_files, backend="hf")
    megatron_preprocess(tmp_path / "all.jsonl", tmp_path / "ref", ["content"], True, hf.encode, 0, 4000)
    same_bytes(tmp_path / "out" / "ds", tmp_path / "ref", ["content"])
    assert summary.tokens["content"] == ds.num_tokens


BAD_LINES = [
    ("invalid_json", b'{"text": "a",}', r"invalid JSON: Expecting property name enclosed in double quotes"),
    ("invalid_json", b"[1, 2]", "invalid JSON: top-level value is list, expected an object"),
    ("missing_key", b'{"other": "x"}', "missing key: no 'text' field"),
    ("non_string", b'{"text": 5}', "non-string value: 'text' is int, expected a string"),
    ("non_string", b'{"text": ["a", "b"]}', "non-string value: 'text' is list"),
    ("invalid_utf8", b'{"text": "caf\xe9"}', "invalid UTF-8: byte 0xe9 at byte offset 13"),
    ("invalid_utf8", b'{"text": "x\\ud800y"}', r"invalid UTF-8: 'text' has an unpaired surrogate .*\\ud800"),
]
GOOD = [b'{"text": "first good line"}', b'{"text": "second"}', b'{"text": ""}', b'{"text": "last"}']


def write_with_bad(path, bad: bytes) -> None:
    path.write_bytes(b"\n".join(GOOD[:2] + [bad] + GOOD[2:]) + b"\n")


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and p.name != "in.jsonl")


@pytest.mark.parametrize("reason, line, message", BAD_LINES)
def test_bad_line_fail_mode_stops_and_leaves_nothing(tmp_path, tok_files, reason, line, message):
    write_with_bad(tmp_path / "in.jsonl", line)
    with pytest.raises(PreprocessError, match=message) as err:
        preprocess(config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), workers=1))
    assert str(err.value).startswith(f"{tmp_path / 'in.jsonl'}:3: ")
    assert err.value.bad.reason == reason and "--on-error skip" in str(err.value)
    assert leftovers(tmp_path) == []


def test_through_the_launcher_the_fix_is_the_launchers_key(tmp_path, tok_files):
    """The preprocess stage of a launch (local or Slurm: the same callable) speaks launch.py's language:
    its failure says data.on_error=skip, not the preprocessing tool's --on-error flag."""
    import json

    from orchestrator.stages.preprocess import PreprocessStage

    write_with_bad(tmp_path / "in.jsonl", BAD_LINES[0][1])
    stage = PreprocessStage([config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), workers=1)],
                            str(tmp_path / "state"), [], "key")
    with pytest.raises(PreprocessError) as err:
        stage()
    marker = json.loads((tmp_path / "state" / "_FAILED").read_text())
    for text in (str(err.value), marker["reason"]):
        assert "rerun with data.on_error=skip to drop bad lines" in text and "--on-error" not in text, text


@pytest.mark.parametrize("reason, line, message", BAD_LINES)
def test_bad_line_skip_mode_drops_counts_and_reports(tmp_path, tok_files, reason, line, message):
    write_with_bad(tmp_path / "in.jsonl", line)
    summary = preprocess(config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), workers=1,
                                on_error="skip", append_eod=True))
    assert summary.skipped == {reason: 1} and summary.documents == 4
    saved = json.loads((tmp_path / "out" / "ds_summary.json").read_text())
    assert saved["skipped"] == {reason: 1} and saved["documents"] == 4
    [example] = saved["skipped_examples"]
    assert example == {"file": str(tmp_path / "in.jsonl"), "line": 3, "reason": reason,
                       "detail": example["detail"]}
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"\n".join(GOOD) + b"\n")
    megatron_preprocess(good, tmp_path / "ref", ["text"], True, GPT2Oracle(*tok_files).encode, 0, 4000)
    same_bytes(tmp_path / "out" / "ds", tmp_path / "ref", ["text"])
    assert leftovers(tmp_path / "out") == ["ds_summary.json", "ds_text_document.bin", "ds_text_document.idx"]


def test_many_bad_lines_across_chunks_and_workers(tmp_path, tok_files):
    lines = []
    for i in range(400):
        reason, bad, _ = BAD_LINES[i % len(BAD_LINES)]
        lines.append(bad if i % 5 == 0 else json.dumps({"text": f"document {i} " * (i % 7)}).encode())
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    base = dict(input=str(tmp_path / "in.jsonl"), on_error="skip", chunk_bytes=512)
    two = preprocess(config(tmp_path, tok_files, workers=2, **base))
    one = preprocess(config(tmp_path, tok_files, workers=1, output_prefix=str(tmp_path / "one"), **base))
    same_bytes(tmp_path / "out" / "ds", tmp_path / "one", ["text"])
    assert two.skipped == one.skipped and sum(two.skipped.values()) == 80 and two.documents == 320
    assert len(two.skipped_examples) == 20 and two.skipped_examples[1]["line"] == 6
    # The first bad line stops a fail-mode run even when it sits in a later chunk of a worker.
    with pytest.raises(PreprocessError, match=r"in.jsonl:1: "):
        preprocess(config(tmp_path, tok_files, input=base["input"], workers=2, chunk_bytes=512,
                          output_prefix=str(tmp_path / "fail")))
    assert not list(tmp_path.glob("fail*")) and not list(tmp_path.glob(".fail*"))


def test_failed_run_keeps_previous_outputs(tmp_path, tok_files):
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(GOOD) + b"\n")
    preprocess(config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), workers=1))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    write_with_bad(tmp_path / "in.jsonl", b"{")
    with pytest.raises(PreprocessError):
        preprocess(config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), workers=1))
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_line_edge_cases(tmp_path, tok_files):
    # Blank lines (Megatron would crash) are counted and ignored; CRLF, a last line without newline and
    # a line longer than a chunk all come through intact.
    long = "x = 1  # " + "é" * 5000
    raw = (b'{"text": "a"}\r\n\n   \n' + json.dumps({"text": long}).encode() + b"\n" + b'{"text": "end"}')
    (tmp_path / "in.jsonl").write_bytes(raw)
    summary = preprocess(config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), chunk_bytes=256,
                                workers=1, progress="bar"))  # the tqdm bar, here into captured stderr
    assert summary.blank_lines == 2 and summary.documents == 3
    tok = load_gpt2_bpe(*tok_files)
    assert [tok.decode(d) for d in IndexedDataset(summary.outputs["text"]).documents()] == ["a", long, "end"]


def test_config_and_input_errors(tmp_path, tok_files):
    with pytest.raises(InputError, match="matches no files"):
        preprocess(config(tmp_path, tok_files, input=str(tmp_path / "nothing*.jsonl")))
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match=r"is a directory, not a JSONL file.*folder/\*\.jsonl.*data\.paths"):
        preprocess(config(tmp_path, tok_files, input=str(tmp_path / "folder")))
    with pytest.raises(ValueError, match="use GPT2BPETokenizer or HuggingFaceTokenizer"):
        config(tmp_path, tok_files, input="x", tokenizer_type="SentencePieceTokenizer")
    with pytest.raises(ValueError, match="on_error='ignore'"):
        config(tmp_path, tok_files, input="x", on_error="ignore")
    with pytest.raises(ValueError, match="workers=0"):
        config(tmp_path, tok_files, input="x", workers=0)
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "x"}\n')
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(InputError, match="bad.gz: cannot read"):
        preprocess(config(tmp_path, tok_files, input=str(tmp_path / "bad.gz"), workers=1))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.data.preprocess", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_megatron_flags_and_errors(tmp_path, tok_files):
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(GOOD) + b"\n")
    prefix = str(tmp_path / "cli")
    # The CodeParrot guide's Megatron command line, verbatim apart from paths.
    args = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--vocab", str(tok_files[0]),
            "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer",
            "--merge-file", str(tok_files[1]), "--json-keys", "text", "--workers", "2", "--chunk-size", "25",
            "--append-eod", "--log-interval", "1"]
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    assert "4 documents" in done.stdout and "processed 4 documents" in done.stderr  # log lines, not a bar
    assert IndexedDataset(f"{prefix}_text_document").num_documents == 4
    write_with_bad(tmp_path / "in.jsonl", b'{"text": 1}')
    done = cli(*args)
    assert done.returncode == 1 and "in.jsonl:3: non-string value: 'text' is int" in done.stderr


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    docs = iter_documents(CorpusConfig(max_bytes=12_000_000))
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _default_sigint() -> None:
    """The run gets SIGINT as a terminal's Ctrl-C gives it, to a process whose SIGINT is the default. A suite
    started in the background inherits SIGINT ignored (POSIX: a non-interactive shell's ``&`` commands), and
    Python then leaves it ignored: the run would finish instead of stopping."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_run_leaves_no_pair(tmp_path, tok_files, big_jsonl, sig):
    """The signal lands mid-run, however fast or slow this machine is: the run logs a line per 16 KiB chunk
    (about 700 lines for 12 MB) into a 4 KiB pipe this test stops reading after the first, so the run
    blocks on its log long before it could publish, until the signal comes."""
    prefix = tmp_path / "big"
    cmd = [sys.executable, "-m", "trainer.data.preprocess", "--input", str(big_jsonl), "--output-prefix",
           str(prefix), "--vocab-file", str(tok_files[0]), "--merge-file", str(tok_files[1]), "--json-keys",
           "content", "--workers", "2", "--log-interval", "1", "--chunk-bytes", "16384", "--progress", "log"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    fcntl.fcntl(proc.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: one page
    try:
        for line in proc.stderr:  # tokenizing is under way: interrupt it
            if "processed" in line:
                break
        proc.send_signal(sig)
        # EOF on stderr only once the workers are gone too: they must not outlive a killed parent.
        proc.communicate(timeout=NEVER_S)
    finally:
        if proc.poll() is None or sig == signal.SIGKILL:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # this test's own process group only
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    finals = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".partial")]
    assert finals == [], finals  # neither .bin nor .idx under its final name
    if sig != signal.SIGKILL:  # a handled interrupt (Ctrl-C, Slurm's SIGTERM) also removes its temp files
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("append_eod", [True, False])
@pytest.mark.parametrize("content", ["", "\n\n", (json.dumps({"content": ""}) + "\n") * 2])
def test_no_training_text_publishes_nothing(tmp_path, tok_files, content, append_eod):
    """An empty file, blank lines or only empty documents: refused before the pair is published, so no
    cache entry that later plans would reuse (and training would fail on) is left."""
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(EmptyDatasetError, match="no training text under the key 'content'.*Nothing was"):
        preprocess(config(tmp_path, tok_files, input=str(tmp_path / "in.jsonl"), workers=1,
                          append_eod=append_eod, json_keys=["content"]))
    assert leftovers(tmp_path) == []


@pytest.fixture
def small_fs(tmp_path):
    """A 200 KiB filesystem (tmpfs; CI runs as root): a disk that fills up part-way through."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        skip_unless_ci(f"cannot mount a small tmpfs here (not root?): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_names_the_folder_the_bytes_needed_and_free(tmp_path, tok_files, stdlib_docs, small_fs):
    from trainer.data.preprocess_io import DiskFullError

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d["content"]}) + "\n" for d in stdlib_docs[:400]))
    with pytest.raises(DiskFullError) as err:
        preprocess(config(tmp_path, tok_files, input=str(src), output_prefix=str(small_fs / "ds"), workers=1,
                          chunk_bytes=65536))
    message = str(err.value)
    m = re.search(r"need about (\d+) bytes .* for (\d+) bytes \(.*\), (\d+) bytes \([0-9.]+ MiB\) are free",
                  message)
    assert message.startswith(f"{small_fs}: no space left") and m, message
    needed, total, free = map(int, m.groups())
    assert os.listdir(small_fs) == []  # nothing published, temporary files removed
    assert total == src.stat().st_size and free == shutil.disk_usage(small_fs).free and needed > free, message

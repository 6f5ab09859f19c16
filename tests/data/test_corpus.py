"""Corpus builder: real stdlib sources → JSONL, deterministic, with limits and honest skipping."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from trainer.config import CorpusConfig
from trainer.data.corpus import build_corpus, default_roots, iter_documents, main


def test_default_corpus_is_this_interpreters_stdlib(tmp_path):
    assert default_roots() == [sysconfig.get_paths()["stdlib"]]
    out = tmp_path / "c.jsonl"
    summary = build_corpus(CorpusConfig(max_files=40), str(out))
    lines = out.read_text().splitlines()
    assert summary.files == len(lines) == 40
    root = Path(sysconfig.get_paths()["stdlib"])
    for line in lines:
        doc = json.loads(line)
        assert set(doc) == {"content", "path"} and doc["path"].endswith(".py")
        assert "site-packages" not in doc["path"]
        assert doc["content"] == (root / doc["path"]).read_text(encoding="utf-8")
    assert summary.bytes == sum(len(json.loads(x)["content"].encode()) for x in lines)
    # Deterministic: a second build is byte-identical.
    again = tmp_path / "again.jsonl"
    build_corpus(CorpusConfig(max_files=40), str(again))
    assert again.read_bytes() == out.read_bytes()


def test_limits_and_test_exclusion():
    docs = list(iter_documents(CorpusConfig(max_bytes=2_000_000, exclude_tests=True)))
    total = sum(len(d["content"].encode()) for d in docs)
    assert 1_500_000 < total <= 2_000_000
    assert not any(part in ("test", "tests", "idle_test") for d in docs for part in Path(d["path"]).parts)


def test_encodings_and_skipped_files(tmp_path):
    root = tmp_path / "src"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "b.py").write_text("x = 'é'\n", encoding="utf-8")
    (root / "a.py").write_bytes("# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n".encode("latin-1"))
    (root / "pkg" / "c.py").write_bytes(b"bad = '\xff\xfe'\n")  # invalid UTF-8, no coding cookie
    (root / "pkg" / "__pycache__" / "d.py").write_text("skip = 1\n")
    (root / "site-packages" / "e.py").write_text("skip = 1\n")
    (root / "notes.txt").write_text("not python\n")
    out = tmp_path / "c.jsonl"
    summary = build_corpus(CorpusConfig(roots=[str(root)]), str(out))
    docs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [d["path"] for d in docs] == ["a.py", "b.py"]
    assert docs[0]["content"] == "# -*- coding: latin-1 -*-\ns = 'café'\n"
    assert summary.undecodable == [str(root / "pkg" / "c.py")]
    assert out.read_bytes().isascii()  # ensure_ascii JSON: no encoding questions for any reader


def test_cli_and_validation(tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    assert main(["--output", str(out), "--max-files", "3", "--exclude-tests"]) == 0
    assert len(out.read_text().splitlines()) == 3 and "3 files" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.partial-*"))
    with pytest.raises(ValueError, match="is not a folder"):
        build_corpus(CorpusConfig(roots=[str(tmp_path / "nope")]), str(out))
    with pytest.raises(ValueError, match="data.corpus.max_files=0"):
        CorpusConfig(max_files=0)

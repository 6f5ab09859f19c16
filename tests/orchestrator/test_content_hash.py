"""The preprocessing cache is keyed by the inputs' bytes (README: "cached by content"): a same-size edit
whose timestamp was restored gets a new key; an unchanged input is not read again on a relaunch."""

import os

from orchestrator.launch.flow import gather_facts
from orchestrator.planning.plan import make_plan
from orchestrator.world import content_hash
from tests.orchestrator.conftest import compose_cfg


def _preprocess_key(data: str) -> str:
    cfg = compose_cfg(["+experiment=codeparrot", f"data.paths=[{data}]", "run_id=r1"])
    return make_plan(cfg, gather_facts(cfg), exists=lambda p: True).stage("preprocess").key


def test_same_size_edit_with_the_old_mtime_restored_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "in.jsonl"
    data.write_text('{"content": "def f(): return 1"}\n')
    before = _preprocess_key(str(data))
    st = os.stat(data)
    data.write_text('{"content": "def f(): return 2"}\n')  # same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p / rsync -t / touch -r leave it
    assert os.stat(data).st_size == st.st_size and os.stat(data).st_mtime_ns == st.st_mtime_ns
    edited = _preprocess_key(str(data))
    assert edited != before

    def no_rehash(path):
        raise AssertionError(f"{path} was hashed again although unchanged")

    monkeypatch.setattr(content_hash, "sha256_file", no_rehash)  # a relaunch: one stat, no read
    assert _preprocess_key(str(data)) == edited
    assert content_hash.memo_path() == tmp_path / "cache" / "slipway" / content_hash.MEMO_FILE


def test_the_fingerprint_is_the_sha256_of_the_bytes(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"x" * (9 << 20))  # more than one read chunk
    expected = "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
    assert content_hash.content_fingerprint(str(data)) == expected
    assert content_hash.content_fingerprint(str(tmp_path / "missing")) is None

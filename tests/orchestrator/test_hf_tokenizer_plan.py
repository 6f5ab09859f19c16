"""tokenizer.type=HuggingFaceTokenizer in the plan: the stages get the directory, the preprocess key its
content hash, and a bad directory stops the plan with the key and the fix."""

from __future__ import annotations

import json
import os

from orchestrator.base.plan_types import Context
from orchestrator.checks import run_checks
from orchestrator.launch.flow import gather_facts
from orchestrator.planning.plan import make_plan
from orchestrator.stages.train import trainer_config
from tests.data.hf_fixtures import BOS, HFOracle, build_tokenizer_dir
from tests.orchestrator.conftest import compose_cfg

TEXTS = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20, "import os\nprint(os.sep)\n" * 20]


def hf_cfg(model_dir):
    return compose_cfg(["+experiment=codeparrot", "tokenizer.type=HuggingFaceTokenizer",
                        f"tokenizer.model={model_dir}", "tokenizer.vocab_file=null",
                        "tokenizer.merge_file=null"])


def test_stages_carry_the_directory_and_key_on_its_content(tmp_path):
    model_dir = build_tokenizer_dir(TEXTS, tmp_path / "tok", 300)
    cfg = hf_cfg(model_dir)
    facts = gather_facts(cfg)
    plan = make_plan(cfg, facts, exists=lambda p: True)
    prep = plan.stage("preprocess")
    assert (prep.job[0].tokenizer_type, prep.job[0].tokenizer_model, prep.job[0].vocab_file) == (
        "HuggingFaceTokenizer", str(model_dir), None)
    assert plan.stage("convert").job.config.tokenizer_model == str(model_dir)
    assert trainer_config(cfg, facts, prep)["tokenizer"]["model"] == str(model_dir)
    assert facts.vocab_from_file == HFOracle(model_dir).vocab_size  # for the plan's memory table
    # Same size and mtime, other content (eos <|endoftext|> -> <s>): new data.
    path = model_dir / "tokenizer_config.json"
    st = os.stat(path)
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "eos_token": BOS}).ljust(st.st_size))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    other = make_plan(cfg, gather_facts(cfg), exists=lambda p: True)
    assert other.stage("preprocess").key != prep.key


def test_bad_tokenizer_directories_stop_the_plan(tmp_path):
    cfg = compose_cfg(["+experiment=codeparrot", "tokenizer.type=HuggingFaceTokenizer"])
    problems = run_checks(Context(cfg), at="plan")
    by_code = {(p.code, p.key): p for p in problems}
    assert by_code["required", "tokenizer.model"].fix == "tokenizer.model=/path/to/tokenizer_dir"
    assert "tokenizer.merge_file=null" in by_code["conflict", "tokenizer.vocab_file"].fix  # codeparrot's
    empty = tmp_path / "empty"
    empty.mkdir()
    [missing] = [p for p in run_checks(Context(hf_cfg(empty)), at="plan") if p.key.startswith("tokenizer")]
    assert (missing.code, missing.value) == ("file_missing", str(empty / "tokenizer.json"))
    no_eos = build_tokenizer_dir(TEXTS, tmp_path / "no_eos", 300, eos=False)
    [problem] = run_checks(Context(hf_cfg(no_eos)), "inputs", at="launch")
    assert (problem.code, problem.key) == ("tokenizer_invalid", "tokenizer.model")
    assert "has no eos token" in problem.message and "eos" in problem.fix

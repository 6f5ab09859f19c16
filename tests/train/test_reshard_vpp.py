"""Interleaved checkpoints (parallel.virtual_pp_size=2): Megatron's layout (``model0``/``model1`` per
shard, chunk-local layer numbers, ``args.virtual_pipeline_model_parallel_size``) in both namings; they
load at v=1 and other (tp, pp) — tp=2 included — with the same eval loss, a v=1 checkpoint loads at
v=2, full resumes across v continue with the saved Adam moments (losses equal to the run resumed at its
own layout), and to_hf converts and verifies them (tp=1 and tp=2)."""

import copy

import pytest
import torch

from tests.fixtures import MEGATRON_FIXTURES
from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from trainer.checkpoint import protocol as ckpt
from trainer.config import RunConfig
from trainer.convert.to_hf import ToHFConfig, convert_checkpoint
from trainer.model.names import layer_index
from trainer.parallel import ParallelState, eval_step, init_distributed
from trainer.run.entry import build_components, load_checkpoint, resolve_load

pytestmark = pytest.mark.slow  # ~30 s on 2 cores: ten 2- or 4-process gloo runs of a 4-layer GPT

ITERS, MORE = 6, 9
TOKENIZER = MEGATRON_FIXTURES / "tokenizer"


def _probe_batch() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 199, (4, 17), generator=g)
    return [{"tokens": tokens[2 * i:2 * i + 2, :-1], "labels": tokens[2 * i:2 * i + 2, 1:]} for i in range(2)]


def _eval(d: dict, pstate: ParallelState) -> float:
    cfg = RunConfig.from_dict(d)
    b = build_components(cfg, pstate)
    if cfg.checkpoint.load_dir or cfg.checkpoint.load:
        load_checkpoint(resolve_load(cfg.checkpoint), b.gpt, b.model, b.parts)
    return eval_step(b.model, _probe_batch()).item()


def _train(rank: int, d: dict, out: str) -> None:
    """Train (or resume) as configured, then the probe loss of the last checkpoint."""
    r = run_cfg(d)
    pstate = init_distributed(RunConfig.from_dict(d).parallel, backend="gloo")
    after = {**d, "checkpoint": {**d["checkpoint"], "load_dir": _ckpt_dir(d)}}
    save_json(f"{out}.{rank}", {"losses": r.losses, "probe": _eval(after, pstate)})


def _load_only(rank: int, d: dict, out: str) -> None:
    pstate = init_distributed(RunConfig.from_dict(d).parallel, backend="gloo")
    save_json(f"{out}.{rank}", {"probe": _eval(d, pstate)})


def _config(tmp_path, name: str, data: str, parallel: dict, iters: int = ITERS, fmt: str = "legacy") -> dict:
    return tiny_config(str(tmp_path / name), data, parallel=parallel,
                       model={"num_layers": 4, "vocab_size": 1024, "hidden_dropout": 0.0,
                              "attention_dropout": 0.0},  # the fixture tokenizer's size (HF conversion)
                       train={"iters": iters, "micro_batch_size": 1, "global_batch_size": 2,
                              "eval_interval": None},
                       checkpoint={"keep": 2, "format": fmt})


def _resumed(src: dict, tmp_path, name: str, parallel: dict, model_only: bool = False) -> dict:
    d = copy.deepcopy(src)
    d["run_dir"], d["parallel"] = str(tmp_path / name), parallel
    d["checkpoint"] = {**d["checkpoint"], "dir": str(tmp_path / name / "checkpoints"),
                       "load_dir": _ckpt_dir(src)}
    if model_only:
        d["checkpoint"]["load"] = "model-only"
    return d


V2 = {"tp_size": 1, "pp_size": 2, "virtual_pp_size": 2}
V1 = {"tp_size": 1, "pp_size": 2}
TP2_V2 = {"tp_size": 2, "pp_size": 2, "virtual_pp_size": 2}


def _ckpt_dir(d: dict) -> str:
    return RunConfig.from_dict(d).checkpoint.dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vpp_ckpt")
    data = write_dataset(str(tmp / "data"))
    out = {"tmp": tmp, "data": data}
    for name, parallel in [("v2", V2), ("v1", V1), ("tp2_v2", TP2_V2)]:
        out[name] = _config(tmp, name, data, parallel)
        world = parallel["tp_size"] * parallel["pp_size"]
        spawn(world, str(tmp), _train, out[name], str(tmp / name))
        out[name + "_result"] = load_json(f"{tmp}/{name}.{world - 1}")
    return out


def test_shards_use_megatrons_interleaved_layout(runs):
    d = runs["v2"]
    shard = ckpt.load_file(ckpt.shard_path(_ckpt_dir(d), ITERS, 0, 1, 2))
    assert "model" not in shard and {"model0", "model1"} <= set(shard)
    assert shard["args"].virtual_pipeline_model_parallel_size == 2
    assert shard["args"].num_layers_per_virtual_pipeline_stage == 1
    for key in ("model0", "model1"):  # one layer per chunk, numbered 0 within it (Megatron's)
        encoder = shard[key]["language_model"]["encoder"]
        assert {layer_index(n) for n in encoder if layer_index(n) is not None} == {0}
    assert "final_layernorm.weight" in shard["model1"]["language_model"]["encoder"]  # rank 1, chunk 1
    assert "word_embeddings_for_head" in shard["model1"] and "word_embeddings_for_head" not in shard["model0"]


@pytest.mark.parametrize("source", ["v2", "tp2_v2"])
def test_v2_checkpoint_loads_at_other_layouts(runs, source):
    tmp, src, probe = runs["tmp"], runs[source], runs[f"{source}_result"]["probe"]
    one = _resumed(src, tmp, f"{source}_at_11", {"tp_size": 1, "pp_size": 1}, model_only=True)
    assert abs(_eval(one, ParallelState.single()) - probe) <= 1e-5 * probe
    other = V1 if source == "v2" else V2  # v=1 at pp=2; tp=2 → tp=1 keeping v=2
    name = f"{source}_at_other"
    spawn(2, str(tmp), _load_only, _resumed(src, tmp, name, other, model_only=True), str(tmp / name))
    assert abs(load_json(f"{tmp}/{name}.1")["probe"] - probe) <= 1e-5 * probe


def _close(a: dict, b: dict, steps) -> None:
    for i in steps:
        assert abs(a[str(i)] - b[str(i)]) <= 1e-5 * b[str(i)], (i, a, b)


def _continue(runs: dict, source: str, name: str, parallel: dict) -> dict:
    """Resume ``source``'s checkpoint fully at ``parallel`` to MORE iterations; the losses after it."""
    tmp, d = runs["tmp"], _resumed(runs[source], runs["tmp"], name, parallel)
    d["train"]["iters"] = MORE
    if parallel.get("pp_size", 1) == 1:
        return {str(k): v for k, v in run_cfg(d).losses.items()}
    spawn(2, str(tmp), _train, d, str(tmp / name))
    return load_json(f"{tmp}/{name}.1")["losses"]


def test_full_resume_across_v_continues_the_run(runs):
    steps = range(ITERS + 1, MORE + 1)
    # The reference: each run resumed at its own layout (same-layout restore, v=2 included).
    v2, v1 = _continue(runs, "v2", "v2_cont", V2), _continue(runs, "v1", "v1_cont", V1)
    assert sorted(v2, key=int)[-3:] == [str(i) for i in steps]
    # v=2 checkpoint → (1, 1) and v=1 checkpoint → v=2 at pp=2: weights and Adam moments resharded, and
    # the next steps equal the reference's (dropout off: the layouts compute the same math).
    _close(_continue(runs, "v2", "v2_to_11", {"tp_size": 1, "pp_size": 1}), v2, steps)
    _close(_continue(runs, "v1", "v1_to_v2", V2), v1, steps)


def test_mcore_naming_and_hf_conversion(runs):
    tmp = runs["tmp"]
    mc = _config(tmp, "v2_mcore", runs["data"], V2, fmt="mcore")
    spawn(2, str(tmp), _train, mc, str(tmp / "v2_mcore"))
    shard = ckpt.load_file(ckpt.shard_path(_ckpt_dir(mc), ITERS, 0, 0, 2))
    assert any(n.startswith("decoder.layers.0.") for n in shard["model1"])  # mcore names, chunk-local
    one = _resumed(mc, tmp, "mcore_at_11", {"tp_size": 1, "pp_size": 1}, model_only=True)
    probe = load_json(f"{tmp}/v2_mcore.1")["probe"]
    assert abs(_eval(one, ParallelState.single()) - probe) <= 1e-5 * probe
    for d, name, tp in ((runs["v2"], "hf_legacy", 1), (mc, "hf_mcore", 1), (runs["tp2_v2"], "hf_tp2", 2)):
        result = convert_checkpoint(ToHFConfig(_ckpt_dir(d), tmp / name, vocab_file=TOKENIZER / "vocab.json",
                                               merge_file=TOKENIZER / "merges.txt"))
        assert result.report.passed and result.report.greedy_identical
        assert (result.provenance.tp_size, result.provenance.pp_size) == (tp, 2)

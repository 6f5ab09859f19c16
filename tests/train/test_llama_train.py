"""The trainer runs the Llama options end to end: a GQA/SwiGLU/rope/RMSNorm/untied model trained at
(tp=2, pp=2) saves Megatron-core-named shards and reshards on load to (1, 1) with the same loss (the GLU
split and the untied output_layer through reshard.py)."""

import copy

import pytest

from tests.train.harness import load_json, spawn, tiny_config, write_dataset
from tests.train.test_reshard import _load, _probe_batch, _train_source
from trainer.parallel import ParallelState, eval_step

pytestmark = pytest.mark.slow  # ~20 s: four gloo ranks

LLAMA = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "position_embedding": "rope", "normalization": "rmsnorm",
         "activation": "swiglu", "add_bias_linear": False, "tie_word_embeddings": False,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}


def test_llama_trains_at_tp2_pp2_and_reshards_to_one_process(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    src = tiny_config(str(tmp_path / "src"), data, parallel={"tp_size": 2, "pp_size": 2}, model=LLAMA,
                      checkpoint={"keep": 2, "format": "mcore"},
                      train={"iters": 6, "micro_batch_size": 1, "global_batch_size": 2,
                             "eval_interval": None})
    spawn(4, str(tmp_path), _train_source, src, str(tmp_path / "src"))
    source = load_json(f"{tmp_path}/src.0")
    assert source["losses"], "the tp2 pp2 run logged no losses"
    one = copy.deepcopy(src)
    one["parallel"] = {"tp_size": 1, "pp_size": 1}
    one["checkpoint"] = {"dir": str(tmp_path / "one"), "load_dir": str(tmp_path / "src" / "checkpoints")}
    loss_11 = eval_step(_load(one, ParallelState.single()), _probe_batch()).item()
    assert abs(loss_11 - source["loss"]) <= 1e-5 * abs(source["loss"]), (loss_11, source["loss"])

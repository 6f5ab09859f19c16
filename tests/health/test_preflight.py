"""Preflight on real gloo worlds: node pairs measured and recorded, a stopped node and a slow node named,
a rank that never checks in named; the pure parts (hostlists, the round-robin schedule, the verdict)."""

import itertools
import json
import os
import sys

import pytest
import torch.multiprocessing as mp

from tests.health.helpers import launch
from trainer.health import HealthConfig
from trainer.preflight import (
    FAILPOINT_ENV,
    PREFLIGHT_JSON,
    _rounds,
    expand_hostlist,
    judge_links,
    run_preflight,
    slurm_node_of,
)

NODES = ["nodeA", "nodeA", "nodeB", "nodeC"]  # rank -> node: two ranks share nodeA


def _preflight(rank: int, run_dir: str, failpoint: str, cfg: dict) -> None:
    import torch

    os.environ["SLIPWAY_NODE_NAME"] = NODES[rank]
    os.environ[FAILPOINT_ENV] = failpoint
    if failpoint == f"absent@{rank}":
        import time

        time.sleep(60)  # never checks in (killed when the others fail)
    run_preflight(HealthConfig(**cfg), run_dir, torch.device("cpu"))


def test_pairs_recorded(tmp_path):
    run_dir = str(tmp_path / "run")
    # The verdict on speeds is the slow-node test's: on this shared machine a healthy link may be slowed
    # several-fold by other processes, so a huge factor here.
    cfg = {"preflight_timeout_s": 20, "preflight_slow_factor": 1e3}
    launch(4, str(tmp_path), _preflight, run_dir, "", cfg)
    report = json.loads((tmp_path / "run" / PREFLIGHT_JSON).read_text())
    sys.stderr.write(f"preflight report: {json.dumps(report)}\n")
    assert report["nodes"] == {"nodeA": [0, 1], "nodeB": [2], "nodeC": [3]}
    pairs = {(a, b) for a, peers in report["links_gbps"].items() for b in peers}
    assert {frozenset(p) for p in pairs} == {frozenset(p) for p in itertools.combinations(NODES[1:], 2)}
    assert all(v > 0 for peers in report["links_gbps"].values() for v in peers.values())
    assert report["problems"] == [] and report["allreduce"]["bus_gbps"] > 0
    assert report["allreduce"]["bytes"] == 4 * 2**20


def _failure(tmp_path, failpoint: str, **cfg) -> str:
    with pytest.raises(mp.ProcessRaisedException) as e:
        launch(4, str(tmp_path), _preflight, str(tmp_path / "run"), failpoint, cfg)
    return str(e.value)


def test_stopped_node_named(tmp_path):
    msg = _failure(tmp_path, "stop@nodeC", preflight_timeout_s=3)
    assert "PreflightError" in msg and "node nodeC did not report" in msg, msg
    report = json.loads((tmp_path / "run" / PREFLIGHT_JSON).read_text())
    assert set(report["links_gbps"]) == {"nodeA", "nodeB"}
    assert report["links_gbps"]["nodeB"]["nodeC"].startswith("error")


def test_slow_node_named(tmp_path):
    # A 1 s delay on each of nodeB's sends: its links are >100x slower than a healthy one on a quiet
    # machine, and still over the factor of 4 when other processes slow a healthy round trip to 250 ms.
    msg = _failure(tmp_path, "slow@nodeB:1000", preflight_timeout_s=20)
    assert "node nodeB is slow" in msg and "nodeA is slow" not in msg and "nodeC is slow" not in msg, msg


def test_missing_rank_named(tmp_path):
    msg = _failure(tmp_path, "absent@2", preflight_timeout_s=3)
    assert "rank 2 did not check in within 3 s" in msg, msg


def test_hostlist_and_slurm_layout():
    assert expand_hostlist("n[1-3,07],gpu") == ["n1", "n2", "n3", "n07", "gpu"]
    assert expand_hostlist("r[08-10]-ib") == ["r08-ib", "r09-ib", "r10-ib"]
    env = {"SLURM_JOB_NODELIST": "n[1-2],x", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert [slurm_node_of(r, env) for r in range(6)] == ["n1", "n1", "n2", "n2", "x", None]
    assert slurm_node_of(0, {}) is None


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_round_robin_covers_every_pair_once(n):
    rounds = _rounds(n)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == list(itertools.combinations(range(n), 2))
    assert all(len({x for p in r for x in p}) == 2 * len(r) for r in rounds)  # disjoint within a round


def test_verdict():
    nodes = ["a", "b", "c", "d"]
    fast = {"a": {"b": 10.0, "c": 9.0, "d": 11.0}, "b": {"c": 10.0, "d": 10.0}, "c": {"d": 12.0}, "d": {}}
    assert judge_links(fast, nodes, 4.0) == []
    slow_d = {"a": {"b": 10.0, "c": 9.0, "d": 1.0}, "b": {"c": 10.0, "d": 2.0}, "c": {"d": 1.5}, "d": {}}
    assert judge_links(slow_d, nodes, 4.0) == [
        "node d is slow: best link 2.000 GB/s vs a median node's 10.000 GB/s (more than "
        "train.preflight_slow_factor=4x slower)"]
    dead_c = {"a": {"b": 10.0, "c": "error: timeout", "d": 11.0}, "b": {"c": "error: timeout", "d": 10.0},
              "c": {"d": "error: timeout"}, "d": {}}
    assert judge_links(dead_c, nodes, 4.0) == ["node c reached none of the other nodes (a, b, d)"]
    two = {"a": {"b": "error: Timed out"}, "b": {}}
    assert judge_links(two, ["a", "b"], 4.0) == ["no answer between nodes a and b: error: Timed out"]
    assert judge_links({"a": {"b": 0.001}, "b": {}}, ["a", "b"], 4.0) == []  # two nodes: no culprit
    assert judge_links({"a": {"b": 5.0, "c": "error: x"}, "b": {"c": "error: x"}}, ["a", "b", "c"], 4.0) == [
        "node c did not report its link measurements (its leader is stuck or unreachable)"]

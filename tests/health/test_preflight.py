"""Preflight on real gloo worlds: node pairs measured and recorded, a stopped node and a slow node named,
a rank that never checks in named; the pure parts (hostlists, the round-robin schedule, the verdict)."""

import itertools
import json
import os
import sys

import pytest
import torch.multiprocessing as mp

from tests.health.helpers import launch
from tests.seam import hook_env
from tests.train.harness import load_json, save_json
from tests.waits import NEVER_S
from trainer.health import HealthConfig
from trainer.health.badnodes import read_bad_nodes
from trainer.health.preflight import (
    PREFLIGHT_JSON,
    _rounds,
    expand_hostlist,
    judge_links,
    run_preflight,
    slurm_node_of,
)
from trainer.run_files import BAD_NODES_DIR

NODES = ["nodeA", "nodeA", "nodeB", "nodeC"]  # rank -> node: two ranks share nodeA
JOB = "4242"


def _named(run_dir, node: str, words: str) -> None:
    """The preflight named ``node`` (and no other) for the batch script and for status
    (trainer/health/badnodes.py), once per healthy node's leader."""
    recs = read_bad_nodes(str(run_dir))
    assert [(r["node"], r["source"], r["job"], r["restart"], r["attempt"]) for r in recs] == [
        (node, "preflight", JOB, 1, 2)], recs
    assert words in recs[0]["why"], recs
    markers = sorted((run_dir / BAD_NODES_DIR).glob(f"{JOB}_r1_a2.*"))
    assert markers and all(m.read_text().startswith(f"{node}\tpreflight: ") for m in markers), markers
    report = json.loads((run_dir / PREFLIGHT_JSON).read_text())
    assert list(report["bad_nodes"]) == [node], report


def _preflight(rank: int, run_dir: str, failpoint: str, cfg: dict) -> None:
    import torch

    os.environ["SLIPWAY_NODE_NAME"] = NODES[rank]
    os.environ.update(hook_env(PREFLIGHT_FAILPOINT=failpoint))
    os.environ.update(SLURM_JOB_ID=JOB, SLURM_RESTART_COUNT="1", SLIPWAY_ATTEMPT="2")  # as in a job's retry
    if failpoint == f"absent@{rank}":
        import time

        time.sleep(NEVER_S)  # never checks in (killed when the others fail)
    run_preflight(HealthConfig(**cfg), run_dir, torch.device("cpu"))


def _preflight_observed(rank: int, run_dir: str, cfg: dict, out_dir: str) -> None:
    """The preflight with its two timed primitives observed from outside: every ping-pong (peer, side,
    seconds) and the all-reduce (its buffer afterwards, and the wall time of the whole call)."""
    import time

    import torch

    from trainer.health import preflight

    os.environ["SLIPWAY_NODE_NAME"] = NODES[rank]
    os.environ.update(hook_env(PREFLIGHT_FAILPOINT=""))
    pings, allreduces = [], []
    ping_pong, time_allreduce = preflight._ping_pong, preflight._time_allreduce

    def observed_ping_pong(peer, first, buf, group, delay):
        seconds = ping_pong(peer, first, buf, group, delay)
        pings.append({"peer": peer, "first": first, "seconds": seconds,
                      "bytes": buf.numel() * buf.element_size()})
        return seconds

    def observed_allreduce(buf, group, world):
        t0 = time.perf_counter()
        result = time_allreduce(buf, group, world)
        wall = time.perf_counter() - t0
        allreduces.append({"result": result, "wall": wall, "values": buf.unique().tolist()})
        return result

    preflight._ping_pong, preflight._time_allreduce = observed_ping_pong, observed_allreduce
    report = run_preflight(HealthConfig(**cfg), run_dir, torch.device("cpu"))
    save_json(os.path.join(out_dir, f"rank{rank}.json"), {"report": report, "pings": pings,
                                                          "allreduces": allreduces})


def test_pairs_recorded(tmp_path):
    run_dir = str(tmp_path / "run")
    # The verdict on speeds is the slow-node test's: on this shared machine a healthy link may be slowed
    # several-fold by other processes, so a huge factor here.
    cfg = {"preflight_timeout_s": NEVER_S, "preflight_slow_factor": 1e3}
    launch(4, str(tmp_path), _preflight_observed, run_dir, cfg, str(tmp_path))
    report = json.loads((tmp_path / "run" / PREFLIGHT_JSON).read_text())
    sys.stderr.write(f"preflight report: {json.dumps(report)}\n")
    seen = [load_json(str(tmp_path / f"rank{r}.json")) for r in range(4)]
    assert report == seen[0]["report"]  # rank 0 wrote what it returned
    nbytes = 4 * 2**20  # preflight_mb=4 (the default) of float32 ones
    assert report["world_size"] == 4 and report["problems"] == []
    assert report["nodes"] == {"nodeA": [0, 1], "nodeB": [2], "nodeC": [3]}
    # Leaders are ranks 0, 2 and 3; each node pair once, recorded by its first node (the side that times a
    # clean round trip), and every rank read the same links back.
    assert {n: sorted(peers) for n, peers in report["links_gbps"].items()} == {
        "nodeA": ["nodeB", "nodeC"], "nodeB": ["nodeC"], "nodeC": []}
    assert all(s["report"]["links_gbps"] == report["links_gbps"] for s in seen)
    # Exactly three round trips per pair on each side, between leaders only, with the full payload.
    sides = {r: sorted((p["peer"], p["first"]) for p in s["pings"]) for r, s in enumerate(seen)}
    assert sides == {0: [(2, True)] * 3 + [(3, True)] * 3, 1: [],
                     2: [(0, False)] * 3 + [(3, True)] * 3, 3: [(0, False)] * 3 + [(2, False)] * 3}
    assert {p["bytes"] for s in seen for p in s["pings"]} == {nbytes}
    leader = {"nodeA": 0, "nodeB": 2, "nodeC": 3}
    for node, peers in report["links_gbps"].items():
        for peer, gbps in peers.items():  # GB/s = the bytes of a round trip / the best of its three times
            best = min(p["seconds"] for p in seen[leader[node]]["pings"] if p["peer"] == leader[peer])
            assert gbps == pytest.approx(2 * nbytes / best / 1e9, rel=1e-9), (node, peer, gbps, best)
    # The all-reduce: one call per rank over all four ranks, a warm-up and three timed rounds on a buffer
    # of ones summed in place, so every element is 4**4; the bus bandwidth is nccl-tests' 2(n-1)/n·bytes/t.
    for s in seen:
        (ar,) = s["allreduces"]
        assert ar["values"] == [4.0**4]
        assert ar["result"] == s["report"]["allreduce"]
    ar = report["allreduce"]
    assert ar["bytes"] == nbytes
    assert ar["bus_gbps"] == pytest.approx(2 * 3 / 4 * nbytes / ar["seconds"] / 1e9, rel=1e-9)
    # The median of three timed rounds: at least two rounds took that long, within the call's wall time.
    assert 0 < 2 * ar["seconds"] <= seen[0]["allreduces"][0]["wall"]


def _failure(tmp_path, failpoint: str, **cfg) -> str:
    with pytest.raises(mp.ProcessRaisedException) as e:
        launch(4, str(tmp_path), _preflight, str(tmp_path / "run"), failpoint, cfg)
    return str(e.value)


# The preflight timeout these tests wait out: long enough that a healthy exchange on a loaded machine
# (milliseconds on a quiet one) never runs into it, so only the failpoint's node is named.
TIMEOUT_S = 6


@pytest.mark.slow  # ~16 s: waits out the timeouts that name the stopped node
def test_stopped_node_named(tmp_path):
    msg = _failure(tmp_path, "stop@nodeC", preflight_timeout_s=TIMEOUT_S)
    assert "PreflightError" in msg and "node nodeC did not report" in msg, msg
    report = json.loads((tmp_path / "run" / PREFLIGHT_JSON).read_text())
    assert set(report["links_gbps"]) == {"nodeA", "nodeB"}
    assert report["links_gbps"]["nodeB"]["nodeC"].startswith("error")
    _named(tmp_path / "run", "nodeC", "did not report its link measurements")


def test_slow_node_named(tmp_path):
    # A 1 s delay on each of nodeB's sends: its links are >100x slower than a healthy one on a quiet
    # machine, and still over the factor of 4 when other processes slow a healthy round trip to 250 ms.
    msg = _failure(tmp_path, "slow@nodeB:1000", preflight_timeout_s=NEVER_S)  # a bound: not reached
    assert "node nodeB is slow" in msg and "nodeA is slow" not in msg and "nodeC is slow" not in msg, msg
    _named(tmp_path / "run", "nodeB", "node nodeB is slow")


def test_missing_rank_named(tmp_path):
    msg = _failure(tmp_path, "absent@2", preflight_timeout_s=TIMEOUT_S)
    assert f"rank 2 did not check in within {TIMEOUT_S} s" in msg, msg


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

"""Preflight at job start (multi-rank worlds): every rank answers, every node pair moves data at a speed
like the others', and an all-reduce across all ranks completes — before any model is built.

1. Check-in through the rendezvous store: each rank posts its node and pid; a rank missing after
   ``preflight_timeout_s`` fails the start naming it (and its node under Slurm's block layout).
2. Node pairs: the first rank of each node (its leader) ping-pongs ``preflight_mb`` with every other
   node's leader, in round-robin rounds of disjoint pairs (N-1 rounds for N nodes), best of three round
   trips. Results go through the store, not a collective, so a node that stopped answering cannot hang
   the others: its links time out (a process group with ``preflight_timeout_s`` as its timeout) and it is
   named. A node whose best link is ``preflight_slow_factor`` times slower than the median node's best
   link is named as slow (with two nodes a slow link has no single culprit: it is recorded, not judged).
3. A timed all-reduce of ``preflight_mb`` across all ranks (bus bandwidth as nccl-tests defines it).

Rank 0 writes ``{run_dir}/preflight.json`` (nodes and their ranks; per rank its host name, network namespace,
the address MASTER_ADDR resolves to there and the one it reaches it from; GB/s per node pair, the all-reduce
figures, problems); every rank raises the same ``PreflightError`` when there are problems, so the job fails
within seconds instead of hanging or crawling through its allocation. A problem with one culprit node (a rank
that never checked in, a silent or unreachable or slow node, ranks of some nodes missing from the all-reduce)
names it in ``bad_nodes`` (trainer/health/badnodes.py): the job's next attempt keeps it out.
When all ranks share one node there are no pairs: check-in and the all-reduce still run.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer import faults
from trainer.health.badnodes import PREFLIGHT, record_bad_nodes
from trainer.health.config import HealthConfig
from trainer.health.heartbeat import expand_hostlist, node_name  # expand_hostlist: re-exported
from trainer.log import get_logger

log = get_logger(__name__)

PREFLIGHT_JSON = "preflight.json"
_REPEATS = 3
_runs = 0  # store keys are per preflight call (a process may run several in tests)


class PreflightError(RuntimeError):
    """A rank or node failed the preflight; the message names it, ``nodes`` the culprits ({node: why})."""

    def __init__(self, message: str, nodes: dict[str, str] | None = None, missing: tuple[int, ...] = ()
                 ) -> None:
        super().__init__(message)
        self.nodes, self.missing = dict(nodes or {}), missing  # missing: the ranks that never checked in


def slurm_node_of(rank: int, env: dict[str, str] | None = None) -> str | None:
    """The node Slurm's default block distribution puts ``rank`` on, if this is a Slurm step."""
    env = dict(os.environ) if env is None else env
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodes or not counts:
        return None
    per_node: list[int] = []
    for item in counts.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            return None
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    start = 0
    for name, n in zip(expand_hostlist(nodes), per_node, strict=False):
        if start <= rank < start + n:
            return name
        start += n
    return None


def _wait_keys(store: Any, keys: list[str], timeout_s: float) -> list[str]:
    """Wait for ``keys``; the ones still missing after ``timeout_s``."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return []
    except Exception:  # noqa: BLE001 — DistStoreError/RuntimeError by version: the missing keys tell
        return [k for k in keys if not store.check([k])]


def identity() -> dict[str, str]:
    """Where this process runs, as the network sees it: its host name, network namespace, the address
    MASTER_ADDR resolves to here and the address this host sends from to reach it (no packet is sent)."""
    out = {"host": socket.gethostname()}
    try:
        out["netns"] = os.readlink("/proc/self/ns/net")
    except OSError:
        pass
    master = os.environ.get("MASTER_ADDR")
    try:
        if master:
            out["master"] = socket.gethostbyname(master)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((out["master"], 9))
                out["addr"] = s.getsockname()[0]
    except OSError:
        pass
    return out


def _check_in(store: Any, rank: int, world: int, timeout_s: float) -> list[dict]:
    store.set(f"hello/{rank}", json.dumps({"rank": rank, "node": node_name(), "pid": os.getpid(),
                                           **identity()}))
    missing = _wait_keys(store, [f"hello/{r}" for r in range(world)], timeout_s)
    if missing:
        ranks = [int(k.split("/")[1]) for k in missing]
        where = [f"rank {r}" + (f" (node {slurm_node_of(r)})" if slurm_node_of(r) else "") for r in ranks]
        nodes = {n: f"rank {r} did not check in within {timeout_s:g} s"
                 for r in ranks if (n := slurm_node_of(r))}
        raise PreflightError(f"preflight: {', '.join(where)} did not check in within {timeout_s:g} s "
                             f"(train.preflight_timeout_s): the process is stuck or its node is unreachable. "
                             f"Drain the node (scontrol update nodename=... state=drain) or exclude it.",
                             nodes, tuple(ranks))
    return [json.loads(store.get(f"hello/{r}")) for r in range(world)]


def _rounds(n: int) -> list[list[tuple[int, int]]]:
    """Round-robin schedule (circle method): every pair of 0..n-1 once, disjoint pairs per round."""
    idx = list(range(n)) + ([-1] if n % 2 else [])
    m, rounds = len(idx), []
    for _ in range(m - 1):
        pairs = [(idx[i], idx[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a >= 0 and b >= 0])
        idx = [idx[0], idx[-1], *idx[1:-1]]
    return rounds


def _ping_pong(peer: int, first: bool, buf: torch.Tensor, group: Any, delay: float) -> float:
    """One round trip with ``peer``; the first side times it."""
    t0 = time.perf_counter()
    for sending in ((True, False) if first else (False, True)):
        if sending:
            time.sleep(delay)
            dist.isend(buf, peer, group=group).wait()
        else:
            dist.irecv(buf, peer, group=group).wait()
    if buf.is_cuda:  # NCCL's wait only orders the stream
        torch.cuda.synchronize(buf.device)
    return time.perf_counter() - t0


@dataclass
class _World:
    rank: int
    size: int
    nodes: list[str]  # in order of their first rank
    leaders: list[int]  # each node's first rank
    ranks_of: dict[str, list[int]]


def _links(world: _World, buf: torch.Tensor, group: Any) -> dict:
    """This leader's measured links: {peer node: GB/s} or {peer node: 'error: ...'}."""
    nodes, leaders = world.nodes, world.leaders
    me = leaders.index(world.rank)
    delay = faults.at("preflight:slow", node=nodes[me]) or 0.0  # a sick link, on purpose
    out: dict[str, Any] = {}
    for pairs in _rounds(len(nodes)):
        for a, b in pairs:
            if me not in (a, b):
                continue
            peer = b if me == a else a
            try:
                best = min(_ping_pong(leaders[peer], me == a, buf, group, delay) for _ in range(_REPEATS))
                if me == a:  # the side that sends first times a clean round trip; the other only answers
                    out[nodes[peer]] = 2 * buf.numel() * buf.element_size() / best / 1e9
            except Exception as e:  # noqa: BLE001 — gloo/NCCL timeouts surface as RuntimeError subclasses
                out[nodes[peer]] = f"error: {str(e).splitlines()[0][:200]}"
    return out


def judge_links(links: dict[str, dict[str, Any]], nodes: list[str], slow_factor: float) -> list[str]:
    """Problems in the node-pair results (``links``: per node leader, its measured links; a node absent
    from ``links`` did not report)."""
    return [message for _, message in judged_links(links, nodes, slow_factor)]


def judged_links(links: dict[str, dict[str, Any]], nodes: list[str], slow_factor: float
                 ) -> list[tuple[str | None, str]]:
    """:func:`judge_links`' problems, each with its culprit node (None: no single node is to blame, as
    for a dead link between the only two nodes)."""
    problems: list[tuple[str | None, str]] = []
    failed: dict[str, set[str]] = {n: set() for n in nodes}
    best: dict[str, float] = {}
    for node, peers in links.items():
        for peer, value in peers.items():
            if isinstance(value, str):
                failed[node].add(peer)
                failed[peer].add(node)
            else:
                best[node] = max(best.get(node, 0.0), value)
                best[peer] = max(best.get(peer, 0.0), value)
    silent = [n for n in nodes if n not in links]
    for n in silent:
        problems.append((n, f"node {n} did not report its link measurements (its leader is stuck or "
                            "unreachable)"))
    for n in nodes:
        if n not in silent and failed[n] and n not in best and len(nodes) > 2:
            # A silent node stalls the round-robin schedule, so links between healthy nodes time out too:
            # then the silent node is the culprit, not this one.
            problems.append((None if silent else n,
                             f"node {n} reached none of the other nodes ({', '.join(sorted(failed[n]))})"))
    if len(nodes) == 2 and failed[nodes[0]] and not silent:
        problems.append((None, f"no answer between nodes {nodes[0]} and {nodes[1]}: "
                               f"{links[nodes[0]].get(nodes[1])}"))
    healthy = [v for v in best.values() if v > 0]
    if len(nodes) > 2 and len(healthy) >= 2:
        median = statistics.median(healthy)
        for n, v in sorted(best.items()):
            if v * slow_factor < median:
                problems.append((n, f"node {n} is slow: best link {v:.3f} GB/s vs a median node's "
                                    f"{median:.3f} GB/s (more than train.preflight_slow_factor="
                                    f"{slow_factor:g}x slower)"))
    return problems


def _time_allreduce(buf: torch.Tensor, group: Any, world: int) -> dict:
    dist.all_reduce(buf, group=group)  # warm-up: connection set-up and buffers
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    nbytes = buf.numel() * buf.element_size()
    return {"seconds": t, "bytes": nbytes, "bus_gbps": 2 * (world - 1) / world * nbytes / t / 1e9}


def _gather_links(store: Any, world: _World, buf: torch.Tensor, group: Any, deadline: float) -> dict:
    """Leaders measure their links and post them; everyone reads every leader's post until ``deadline``
    (a leader missing from the result did not report)."""
    if len(world.nodes) < 2:
        return {}
    if world.rank in world.leaders:
        store.set(f"links/{world.rank}", json.dumps(_links(world, buf, group)))
    _wait_keys(store, [f"links/{r}" for r in world.leaders], max(deadline - time.perf_counter(), 0.001))
    return {n: json.loads(store.get(f"links/{r}")) for n, r in zip(world.nodes, world.leaders, strict=True)
            if store.check([f"links/{r}"])}


def _agreed_allreduce(store: Any, world: _World, buf: torch.Tensor, group: Any, deadline: float
                      ) -> tuple[dict, list[tuple[str | None, str]]]:
    """The timed all-reduce, and the problems every rank agrees on (through the store, so a rank whose
    all-reduce failed cannot leave the others to hang in the next collective), each with its culprit
    node: the nodes of the ranks that never finished it, when they are not all of the job's."""
    try:
        result, mine = _time_allreduce(buf, group, world.size), "ok"
    except Exception as e:  # noqa: BLE001 — gloo/NCCL timeouts surface as RuntimeError subclasses
        result, mine = {}, str(e).splitlines()[0][:200]
    store.set(f"allreduce/{world.rank}", mine)
    keys = [f"allreduce/{r}" for r in range(world.size)]
    missing = _wait_keys(store, keys, max(deadline - time.perf_counter(), 0.001))
    failed = sorted({store.get(k).decode() for k in keys if k not in missing} - {"ok"})
    if not (missing or failed):
        return result, []
    msg = f"an all-reduce across all {world.size} ranks did not complete"
    where: set[str] = set()
    if missing:
        ranks = [int(k.split("/")[1]) for k in missing]
        where = {n for n, rs in world.ranks_of.items() if set(rs) & set(ranks)}
        msg += f" (ranks {ranks} on {', '.join(sorted(where))} never finished it)"
    msg += f": {failed[0]}" if failed else ""
    culprits = sorted(where) if where and len(where) < len(world.nodes) else [None]
    return result, [(node, msg) for node in culprits]


def run_preflight(cfg: HealthConfig, run_dir: str, device: torch.device) -> dict:
    """Run the preflight on the default process group (see the module doc); returns the report."""
    global _runs
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    _runs += 1
    t0 = time.perf_counter()
    rank, size, timeout = dist.get_rank(), dist.get_world_size(), cfg.preflight_timeout_s
    store = dist.PrefixStore(f"slipway-preflight-{_runs}", dist.distributed_c10d._get_default_store())
    try:
        hello = _check_in(store, rank, size, timeout)
    except PreflightError as err:
        if rank == min(set(range(size)) - set(err.missing)):  # one reporter: the first rank that answered
            record_bad_nodes(run_dir, err.nodes, PREFLIGHT)
        raise
    t_in = time.perf_counter()  # every rank passes the check-in within a store round trip of the others
    nodes = list(dict.fromkeys(h["node"] for h in hello))
    ranks_of = {n: [h["rank"] for h in hello if h["node"] == n] for n in nodes}
    world = _World(rank, size, nodes, [ranks_of[n][0] for n in nodes], ranks_of)
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    faults.at("preflight:stop", node=node_name() if rank in world.leaders else "")
    buf = torch.ones(max(int(cfg.preflight_mb * 2**20) // 4, 1), dtype=torch.float32, device=device)
    # Deadlines shared by all ranks (counted from the check-in), so they reach the verdict together and
    # none is killed (srun --kill-on-bad-exit) before rank 0 wrote the report. A leader loses at most one
    # timeout per dead peer; the rest of a round takes milliseconds.
    deadline = t_in + 2 * timeout + 0.5 * len(_rounds(len(nodes)))
    links = _gather_links(store, world, buf, group, deadline)
    judged = judged_links(links, nodes, cfg.preflight_slow_factor) if links else []
    allreduce = None
    if not judged:
        allreduce, judged = _agreed_allreduce(store, world, buf, group, deadline + timeout)
    problems = list(dict.fromkeys(message for _, message in judged))
    culprits: dict[str, str] = {}
    for node, message in judged:
        if node is not None:
            culprits.setdefault(node, message)
    report: dict[str, Any] = {"world_size": size, "nodes": ranks_of, "ranks": hello, "links_gbps": links,
                              "problems": problems, "bad_nodes": culprits}
    if allreduce is not None:
        report["allreduce"] = allreduce
    report["seconds"] = time.perf_counter() - t0
    if rank == 0 or problems:  # any rank that fails leaves the report (same content, atomic renames)
        _write_report(run_dir, report)
    # The culprits, once per healthy node (its leader; rank 0 when every node is named).
    me = world.nodes[world.leaders.index(rank)] if rank in world.leaders else None
    if problems and ((me is not None and me not in culprits) or (rank == 0 and set(culprits) >= set(nodes))):
        record_bad_nodes(run_dir, culprits, PREFLIGHT)
    dist.destroy_process_group(group)
    if problems:
        raise PreflightError("preflight failed: " + "; ".join(problems) + f" (details: "
                             f"{os.path.join(run_dir, PREFLIGHT_JSON)}). The job's next attempt keeps the "
                             "node named out of its allocation (where the partition has another).", culprits)
    if rank == 0:
        ar = report["allreduce"]
        log.info("preflight: %d ranks on %d node(s) answered; all-reduce %.1f MB in %.1f ms (bus %.2f GB/s)"
                 "%s; %.2f s", size, len(nodes), ar["bytes"] / 2**20, ar["seconds"] * 1e3, ar["bus_gbps"],
                 _links_summary(links), report["seconds"])
    return report


def _links_summary(links: dict[str, dict[str, Any]]) -> str:
    values = [v for peers in links.values() for v in peers.values() if not isinstance(v, str)]
    return f"; node pairs {min(values):.2f}-{max(values):.2f} GB/s" if values else ""


def _write_report(run_dir: str, report: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, PREFLIGHT_JSON)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)

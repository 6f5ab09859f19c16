"""The multi-node launch across devcluster nodes that are hosts of their own (slurm/devcluster_lib/hosts.py):
``codeparrot_smoke`` at tp 1 x pp 1 on two nodes, data parallelism across them (one rank per node).

One module fixture builds a tiny dataset, submits every run at once (they share one preprocessing job),
then trains the single-host reference (the local executor, both ranks on this machine) while the Slurm
runs go on:

- ``multi``: the site's ``cluster.env`` names the gloo interface (GLOO_SOCKET_IFNAME=eth0). Every rank runs
  in the network namespace of its node, rendezvous is at the first node's address, and the losses equal
  the single-host run's.
- ``cut``: on partition ``spare`` (n3-n5, nodes no other run uses). Both ranks pause after iteration 5 (a
  checkpoint at 4); a driver thread takes the second node's link down and lets them go on into the next
  collective, which can never complete. Every rank's hang watchdog fires at ``train.hang_timeout_s`` and names
  the node that lost contact; Slurm ends the step (the node does not answer), and the job is requeued onto the
  spare node, resumes from the checkpoint and ends with the reference's losses. Nothing of it is left running
  once the link is back.
- ``nodelocal``: with two stages of its own (tests/orchestrator/handoff_stages.py): one leaves a file for
  the next in /tmp, which is each node's own; the next, on both nodes, fails on the node that cannot see
  it, with a line naming the path and the node (training fails at its start there: not its subject).

A MASTER_ADDR the nodes cannot reach is named by the start-up preflight on both nodes (a plain two-node
step). Costs about three minutes on two cores (the runs overlap); the cut run waits for Slurm to give up
on the node (SlurmdTimeout).
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator import stages
from orchestrator.launch.flow import launch
from orchestrator.readback.status import collect, format_rows
from orchestrator.record.launches import current
from tests.devcluster import layout, node_addresses, require_hosts, set_link, settings
from tests.orchestrator import handoff_stages
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import (
    TINY_MODEL,
    cancel_runs,
    job_ids,
    log_text,
    losses,
    tiny_dataset,
    wait_for,
    wait_states,
)
from tests.seam import hook_env
from tests.slurm_cli import slurm
from tests.waits import JOB_S, NEVER_S, wait_until
from trainer.formulas import master_port
from trainer.run_files import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]

ITERS = 12
HANG_S = 20  # the cut run's watchdog: the driver acts within it after the pause starts (a poll away)
STALL = 5  # the cut run pauses after this iteration; it saved at 4
COMMON = [
    "+experiment=codeparrot_smoke", *TINY_MODEL, "parallel.tp_size=1", "parallel.pp_size=1",
    f"train.iters={ITERS}", "train.save_interval=4", "train.eval_interval=100", "train.deterministic=true",
    "convert.enabled=false", "eval=none", "logging.wandb.mode=disabled", "kernels=eager", "wait=false",
    "+cluster.env.OMP_NUM_THREADS=1",  # one thread per rank on either executor: the same arithmetic
]
TWO_NODES = ["cluster=devcluster", "cluster.nodes=2", "cluster.tasks_per_node=1"]
DONE = {"preprocess": "COMPLETED", "train": "COMPLETED"}
RUNS = {
    "multi": [*TWO_NODES, "+cluster.env.GLOO_SOCKET_IFNAME=eth0"],
    "cut": [*TWO_NODES, "cluster.partition=spare", f"train.hang_timeout_s={HANG_S}",
            "train.heartbeat_interval_s=0.5", f"+cluster.env.SLIPWAY_STALL_TRAIN={STALL}"],
    "nodelocal": [*TWO_NODES, "+cluster.env.SLIPWAY_FAIL_TRAIN=start"],
}


@dataclass
class World:
    root: Path
    runs: dict[str, Path]
    reference: dict[int, float] = field(default_factory=dict)  # the single-host run's losses
    cut: dict[str, str] = field(default_factory=dict)  # what the driver did
    stop: threading.Event = field(default_factory=threading.Event)


def _second_node(job: str) -> str:
    nodes = slurm("squeue", "-h", "-j", job, "-o", "%N").strip()
    return slurm("scontrol", "show", "hostnames", nodes).split()[1]


def _drive(w: World) -> None:
    """Cut the ``cut`` run's second node off once both ranks paused after iteration STALL, then let them
    go on (the stall hook's resume file: the run directory is on shared storage, which the cut spares)."""
    state = w.runs["cut"] / "stages" / "train"
    while not w.stop.wait(0.1):
        if all((state / f"stalled_{STALL}_rank{r}").exists() for r in (0, 1)):
            try:
                job = job_ids(w.runs["cut"])["train"]
                node = _second_node(job)
                set_link(node, up=False)
                pid = RunDir(w.runs["cut"]).rank_pid(1).read_text().split()[0]
                w.cut.update(job=job, node=node, rank1_pid=pid)
                (state / f"resume_{STALL}").touch()
            except Exception as err:  # noqa: BLE001 - reported by the test that needed the cut
                w.cut["error"] = repr(err)
            return


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    require_hosts()
    root = tmp_path_factory.mktemp("multinode")
    data = tiny_dataset(root)
    runs = {name: root / "runs" / "codeparrot_smoke" / name for name in RUNS}
    w = World(root, runs)
    driver = threading.Thread(target=_drive, args=(w,), daemon=True)
    os.environ.update(hook_env())  # the stall hook is allowed in this module's launches and jobs
    for stage in handoff_stages.STAGES:  # planned only for the run named nodelocal
        stages.register(stage)
    try:
        for name, extra in RUNS.items():
            over = [*COMMON, *data, f"runs_root={root}/runs", f"cache_dir={root}/cache", f"run_id={name}",
                    *extra]
            launch(compose_cfg(over), out=io.StringIO())
        driver.start()
        w.reference = _single_host(root, data)
        yield w
    finally:
        for name in hook_env():
            os.environ.pop(name, None)
        w.stop.set()
        if "node" in w.cut:
            set_link(w.cut["node"], up=True)
        cancel_runs(list(runs.values()))
        for stage in handoff_stages.STAGES:
            stages.unregister(stage.name)
        handoff = handoff_stages.handoff_dir(str(runs["nodelocal"]))
        for node in node_addresses():  # the nodes' own /tmp folders are in the cluster's state folder
            shutil.rmtree(layout().node_dir(node) / "tmp" / handoff.name, ignore_errors=True)
        shutil.rmtree(handoff, ignore_errors=True)


def _single_host(root: Path, data: list[str]) -> dict[int, float]:
    """The same training on this machine alone (local executor: two ranks, dp 2), to the end."""
    over = [*COMMON, *data, "cluster=local", "cluster.tasks_per_node=2", f"runs_root={root}/local",
            f"cache_dir={root}/local-cache", "run_id=single", "wait=true"]
    run = Path(launch(compose_cfg(over), out=io.StringIO()).plan.run_dir)
    got = losses(run)
    assert sorted(got) == list(range(1, ITERS + 1)), got
    return got


def test_data_parallel_across_two_nodes_meets_at_the_first_node_and_equals_the_single_host_run(world):
    run = world.runs["multi"]
    assert wait_states(run) == DONE, format_rows(collect(str(run)))
    report = json.loads((run / "preflight.json").read_text())
    addresses = node_addresses()
    assert report["nodes"] == {"n1": [0], "n2": [1]}, report["nodes"]  # one rank per node, n1 first
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert len({r["netns"] for r in ranks.values()}) == 2  # a network namespace of its own per node
    assert os.readlink("/proc/self/ns/net") not in {r["netns"] for r in ranks.values()}  # not the launcher's
    for r in ranks.values():
        assert r["host"] == r["node"], r  # the node's own host name
        assert r["master"] == addresses["n1"], r  # MASTER_ADDR (n1) is the first node's address everywhere
        assert r["addr"] == addresses[r["node"]], r  # each reaches it from its own address on eth0
    job = job_ids(run)["train"]
    first = (run / "logs" / f"train_{job}_r0_a0_0.err").read_text()
    n1 = addresses["n1"]
    assert f"rendezvous n1:{master_port(int(job))} ({n1}) on node n1; sockets: GLOO_SOCKET_IFNAME=eth0 " \
           f"(eth0 {n1}), NCCL_SOCKET_IFNAME unset" in first, first[-3000:]
    got = losses(run)
    assert got == pytest.approx(world.reference, rel=0, abs=0), (got, world.reference)  # equal, not close
    # The preprocessing ran on a node too (its marker says where), not on the launching host.
    prep = Path(current(json.loads((run / "run.json").read_text()))["stages"]["preprocess"]["dir"])
    done = json.loads((prep / "_COMPLETE").read_text())
    assert done["node"] in ("n1", "n2") and done["host"] == done["node"], done


def test_a_link_cut_mid_training_names_the_node_and_the_job_resumes_on_the_spare(world):
    run = world.runs["cut"]
    wait_for(lambda: "node" in world.cut or "error" in world.cut, JOB_S, "the driver to cut a node off")
    assert "error" not in world.cut, world.cut
    cut, job = world.cut["node"], world.cut["job"]
    # The cut node's rank ends itself (its watchdog) while the node is still cut off from everything.
    wait_until(lambda: not Path(f"/proc/{world.cut['rank1_pid']}").exists(), "the cut node's rank to end")
    assert wait_states(run) == {"train": "COMPLETED"}, format_rows(collect(str(run)))  # (multi's preprocess)
    set_link(cut, up=True)  # the cable back (the node back in service too)
    runs = [slurm("scontrol", "show", "hostnames", x.split("|")[0]).split()
            for x in slurm("sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "NodeList,State").split()]
    assert len(runs) >= 2 and runs[0][1] == cut and cut not in runs[-1], runs  # then the spare instead
    leader = runs[0][0]
    # Within the watchdog's limit, each rank named the node that lost contact, from its side of the cut.
    first = log_text(run, f"train_{job}_r0_a0_*.err")
    assert f"(train.hang_timeout_s={HANG_S}) at iteration {STALL}, phase train; node {cut} lost contact: " \
           f"node {leader} got no answer from it" in first, first[-4000:]
    assert f"node {cut} lost contact: it reached none of {leader}, " in first, first[-4000:]
    hangs = [json.loads(x) for x in (run / "hangs.jsonl").read_text().splitlines()]
    assert {h["reporter"] for h in hangs} == {0, 1} and all(list(h["lost_contact"]) == [cut] for h in hangs)
    assert all(h["idle_s"] < 2 * HANG_S for h in hangs), hangs  # the watchdog's limit, not gloo's 30 min
    named = [json.loads(x) for x in (run / "bad_nodes.jsonl").read_text().splitlines()]
    assert {(n["node"], n["source"]) for n in named} == {(cut, "watchdog")}, named
    # Resumed from the checkpoint before the cut; nothing lost: the single-host run's losses, every one.
    again = log_text(run, f"train_{job}_r1_a0_0.err")
    assert f"loaded checkpoint from {run / 'checkpoints'} iteration 4" in again, again[-3000:]
    assert losses(run) == pytest.approx(world.reference, rel=0, abs=0)
    # Nothing of the job is left running on any node, the cut one included, once its link is back.
    wait_until(lambda: not _processes_of(job), f"no process of job {job} left", NEVER_S)
    table = format_rows(collect(str(run)))
    assert f"iteration {STALL}: stopped progressing: node {cut} lost contact (watchdog fired on ranks 0, 1" \
        in table, table
    assert f"BAD NODE: run cut: {cut} named by the watchdog (job {job}, restart 0, attempt 0): node {cut} " \
           "lost contact" in table, table
    assert "Slurm ended that run of the job before its batch script decided" in table, table


def _processes_of(job: str) -> list[int]:
    """Live processes (any node's: they are all on this machine) of Slurm job ``job``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if entry.isdigit() else []
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env:
            found.append(int(entry))
    return found


def test_a_file_left_in_node_local_tmp_fails_the_next_stage_naming_path_and_node(world):
    run = world.runs["nodelocal"]
    states = wait_states(run)
    write, read = handoff_stages.WRITE, handoff_stages.READ
    assert (states[write], states[read]) == ("COMPLETED", "FAILED"), format_rows(collect(str(run)))
    handoff = handoff_stages.handoff_dir(str(run))
    wrote = [n for n in ("n1", "n2") if (layout().node_dir(n) / "tmp" / handoff.name / "_COMPLETE").exists()]
    assert len(wrote) == 1, wrote  # in the /tmp of the node that ran the writer, and nowhere else
    assert not (handoff / handoff_stages.FILE).exists()  # (nor on the login node)
    other = "n2" if wrote == ["n1"] else "n1"
    ids = job_ids(run)
    text = log_text(run, f"{read}_{ids[read]}_*.err")
    assert f"UpstreamNotVisible: upstream output {handoff}/_COMPLETE is not on node {other} (host {other}) " \
           f"60 s after its job {ids[write]} completed on {wrote[0]} (afterok)" in text, text[-4000:]
    assert "Put runs_root and cache_dir on a filesystem every node mounts" in text


# A two-node step that starts the trainer's process group with a MASTER_ADDR the nodes cannot use.
BAD_ADDR = r"""
import json, os, sys
from trainer.config import RunConfig
from trainer.parallel import ParallelConfig
from trainer.parallel.launch import init_distributed
from trainer.run.entry import _rendezvous_check
before = _rendezvous_check(RunConfig.from_dict({"train": {"preflight_timeout_s": 3}}))
for addr in sys.argv[1:]:
    os.environ["MASTER_ADDR"] = addr
    try:
        init_distributed(ParallelConfig(), backend="gloo", timeout_s=1800, before=before)
        print(json.dumps({"addr": addr, "error": None}))
    except Exception as e:
        print(json.dumps({"addr": addr, "node": os.environ["SLURMD_NODENAME"], "error": str(e)}))
"""


def test_a_master_addr_the_nodes_cannot_use_is_named_by_the_preflight(tmp_path):
    """Not resolvable; a node outside the job (it answers, nobody listens); an address of the cluster's
    range nobody has (no answer). Each named within seconds on both nodes, not after 30 minutes."""
    require_hosts()
    script = tmp_path / "bad_addr.py"
    script.write_text(BAD_ADDR)
    unused = str(ipaddress.ip_network(settings().subnet)[-2])  # in the cluster's range; no node has it
    cases = ["nowhere-slipway", "g2", unused]
    out = slurm("srun", "-p", "cpu", "-N2", "-n2", "-t", "5", f"--export=ALL,PYTHONPATH={REPO}",
                sys.executable, str(script), *cases, timeout=NEVER_S)
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    seen = {(r["node"], r["addr"]): r["error"] for r in rows}
    g2 = node_addresses()["g2"]
    assert "MASTER_ADDR=nowhere-slipway does not resolve on node n1" in seen["n1", "nowhere-slipway"]
    assert "MASTER_ADDR=nowhere-slipway does not resolve on node n2" in seen["n2", "nowhere-slipway"]
    assert f"MASTER_ADDR=g2 ({g2}) is not an address of node n1, where rank 0 runs" in seen["n1", "g2"]
    assert "rank 1 on node n2 got no connection from the rendezvous MASTER_ADDR=g2:" in seen["n2", "g2"]
    assert "refused: the host answers but nothing listens" in seen["n2", "g2"]
    assert "is not an address of node n1" in seen["n1", unused]
    assert f"({unused}) within 3 s" in seen["n2", unused] and "refused" not in seen["n2", unused]

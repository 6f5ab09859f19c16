"""Bad nodes: what the preflight and the watchdog record (trainer/health/badnodes.py), what the batch script
decides with it (render.py's ``slipway_exclude``, run here by bash against stand-ins for Slurm's clients
that record every call), and what ``status`` says (orchestrator/world/progress.py). The real thing on the
devcluster: tests/orchestrator/test_bad_node.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.base.plan_types import JobResources
from orchestrator.render import ScriptSpec, render_sbatch
from orchestrator.world.progress import bad_nodes
from trainer.health.badnodes import WATCHDOG, read_bad_nodes, record_bad_nodes
from trainer.run_files import BAD_NODES_DIR, EXCLUSIONS, REQUEUES

SLURM_ENV = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0", "SLIPWAY_ATTEMPT": "1"}


def test_every_reporter_writes_its_own_marker_and_status_reads_each_node_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for _ in range(2):  # two ranks naming the same node (their own processes: here, twice)
        record_bad_nodes(str(run), {"n2": "rank 1 on n2 stopped\nprogressing"}, WATCHDOG, SLURM_ENV)
    recs = read_bad_nodes(str(run))
    assert [(r["node"], r["job"], r["restart"], r["attempt"], r["why"]) for r in recs] == [
        ("n2", "77", 0, 1, "rank 1 on n2 stopped progressing")]
    markers = list((run / BAD_NODES_DIR).glob("77_r0_a1.*"))
    text = "n2\twatchdog: rank 1 on n2 stopped progressing\n"
    assert markers and all(m.read_text() == text for m in markers)
    record_bad_nodes(str(run), {"n1": "slow"}, "preflight", {})  # a local run: history only, no marker
    assert [r["node"] for r in read_bad_nodes(str(run))] == ["n2", "n1"]
    assert len(list((run / BAD_NODES_DIR).iterdir())) == len(markers)


def _stubs(tmp_path: Path, *, nodes: str, requeuehold: int, sbatch: str = "echo 91") -> dict[str, str]:
    """Slurm's clients as the exclusion function calls them; every call is appended to ``calls``."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scripts = {
        "scontrol": f'echo "scontrol $*" >> {calls}\ncase "$1 $2" in\n'
                    '  "show job") echo "JobId=77 ExcNodeList=n9 Partition=debug" ;;\n'
                    '  "show hostnames") echo "$3" | tr , "\\n" ;;\n'
                    f'  requeuehold*) exit {requeuehold} ;;\nesac',
        "sinfo": f'echo "sinfo $*" >> {calls}\nprintf "{nodes}"',
        "sbatch": f'echo "sbatch $*" >> {calls}\n{sbatch}',
        "scancel": f'echo "scancel $*" >> {calls}',
        "sleep": f'echo "sleep $*" >> {calls}\nkill -9 $PPID',  # the requeue ends the script here
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NAME": "exp-r1-train"}


def _exclude(tmp_path: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """Run the rendered script's exclusion function for node n2; (exit code, exclusions file, calls)."""
    res = JobResources("x", nodes=2, signal_delay_s=30, max_retries=1)
    spec = ScriptSpec(res, "true", str(tmp_path / "logs"), "train", "r1", str(tmp_path / "st"),
                      run_dir=str(tmp_path), helper=(("partition", "cpu"),))
    script = render_sbatch(spec)
    function = script[script.index("slipway_exclude() {"):script.index("\n}\n") + 2]
    (tmp_path / "st").mkdir(exist_ok=True)
    body = f"state={tmp_path / 'st'}\nlogs={tmp_path / 'logs'}\nrestart=0\nattempt=1\n{function}\n" \
           'slipway_exclude n2; echo "returned $?"\n'
    out = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=60)
    decisions = (tmp_path / "st" / EXCLUSIONS)
    calls = (tmp_path / "calls")
    return out.returncode, decisions.read_text() if decisions.exists() else "", \
        calls.read_text() if calls.exists() else out.stderr


def test_the_batch_script_requeues_held_with_a_helper_that_excludes_the_node(tmp_path):
    env = _stubs(tmp_path, nodes="n1 alloc\\nn2 alloc\\nn3 idle\\nn4 drain\\nn5 idle*\\nn9 idle\\n",
                 requeuehold=0)
    rc, decisions, calls = _exclude(tmp_path, env)
    assert rc != 0  # ended by the requeue (here: the stand-in for its sleep)
    assert decisions.startswith(decisions.split()[0] + " excluded n2 job=77 restart=0 attempt=1 "
                                "exclude=n2,n9 helper=91"), decisions
    assert "exclude=n2" in (tmp_path / "st" / REQUEUES).read_text()
    sbatch = calls[calls.index("sbatch "):]
    assert "--partition=cpu" in sbatch and "--job-name=exp-r1-train-exclude" in sbatch
    assert "scontrol update jobid=77 ExcNodeList=n2,n9; scontrol release 77" in sbatch
    assert "scontrol requeuehold 77" in calls and "scancel" not in calls


@pytest.mark.parametrize("case,nodes,requeuehold,sbatch,why", [
    # n1 and n3 usable (n4 drained, n5 not responding, n9 excluded already): 1 left for a 2-node job
    ("partition", "n1 alloc\\nn2 alloc\\nn4 drain\\nn5 idle*\\nn9 idle\\n", 0, "echo 91",
     "partition debug would keep 1 usable node(s) for this 2-node job"),
    ("helper", "n1 alloc\\nn2 alloc\\nn3 idle\\n", 0, "exit 1",
     "the helper job that excludes them was refused"),
    ("requeue", "n1 alloc\\nn2 alloc\\nn3 idle\\n", 1, "echo 91",
     "scontrol requeuehold was refused (the cluster must allow requeues: JobRequeue)"),
])
def test_the_batch_script_keeps_a_node_it_cannot_exclude(tmp_path, case, nodes, requeuehold, sbatch, why):
    rc, decisions, calls = _exclude(tmp_path, _stubs(tmp_path, nodes=nodes, requeuehold=requeuehold,
                                                     sbatch=sbatch))
    last = decisions.splitlines()[-1]
    assert rc == 0 and last.endswith(f" kept n2 job=77 restart=0 attempt=1 why={why}"), (decisions, calls)
    assert ("scancel 91" in calls) == (case == "requeue")  # a helper whose job was not requeued goes


def test_status_says_which_node_why_and_what_was_done(tmp_path):
    run, state = tmp_path / "run", tmp_path / "run" / "stages" / "train"
    state.mkdir(parents=True)
    record_bad_nodes(str(run), {"n2": "rank 1 on n2 stopped"}, WATCHDOG, SLURM_ENV)
    record_bad_nodes(str(run), {"n3": "node n3 is slow"}, "preflight",
                     {**SLURM_ENV, "SLURM_RESTART_COUNT": "1"})
    record_bad_nodes(str(run), {"n4": "late"}, WATCHDOG, {**SLURM_ENV, "SLURM_RESTART_COUNT": "2"})
    record_bad_nodes(str(run), {"here": "x"}, WATCHDOG, {})
    (state / EXCLUSIONS).write_text(
        "1 excluded n2 job=77 restart=0 attempt=1 exclude=n2 helper=91\n"
        "2 kept n3 job=77 restart=1 attempt=1 why=partition debug would keep 1 usable node(s) for this "
        "2-node job\n")
    lines = bad_nodes(run, state)
    assert lines[0] == ("n2 named by the watchdog (job 77, restart 0, attempt 1): rank 1 on n2 stopped; "
                        "excluded from the job's next allocation (ExcNodeList=n2, set by helper job 91)")
    assert lines[1].endswith("kept (partition debug would keep 1 usable node(s) for this 2-node job); the "
                             "step was retried in the same allocation")
    assert "no decision recorded" in lines[2] and lines[3].endswith("a local run: nothing to exclude")

"""docs/cluster.md's walkthrough, followed literally (issue 37): its example site file (2 nodes of 4 H100s)
written where the page says a site folder may be, and every launch command of the page and of the README's
summary run as a dry run through launch.py. Each must plan what the site can run: 4 GPUs per node on at
most 2 nodes, the CPU stages on the site's CPU partition with slurm.yaml's stage time limit and NCCL
settings kept, and no problem but what this machine cannot have (the input files, pyxis in srun, the
site's Slurm controller). The sweeps (``-m``) are dry runs too: every point planned, one summary, nothing
written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from math import prod

import pytest

from tests.orchestrator.conftest import REPO
from tests.orchestrator.sites import docs_site, site_file

# What a dry run on this machine cannot have: the CodeParrot data, the tokenizer and the image are the
# user's; pyxis is a plugin of the site's srun; the site's Slurm controller answers on the site only, and
# the Slurm this machine does reach (the devcluster, under make test) has other partitions than the site's
# (checks/cluster.py partition_problems: what sinfo says of them).
ELSEWHERE = {"file_missing", "pyxis_missing", "slurm_unreachable", "partition_gpus", "partition_cpus",
             "partition_memory", "partition_nodes", "partition_unknown", "account", "qos", "time_limit"}


def _commands(sweeps: bool = False) -> list[str]:
    """Every single-run (or, with ``sweeps``, every ``-m``) ``python launch.py ... cluster=mysite ...`` line
    of the walkthrough, in order."""
    out: list[str] = []
    for page in (REPO / "docs" / "cluster.md", REPO / "README.md"):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            for line in block.splitlines():
                line = re.split(r"(?:^|\s)#", line)[0].strip()  # bash: a comment starts a word
                if line.startswith("python launch.py") and "cluster=mysite" in line \
                        and (" -m " in line) == sweeps:
                    if line not in out:
                        out.append(line)
    return out


COMMANDS = _commands()
SWEEPS = _commands(sweeps=True)


def test_the_walkthrough_has_its_commands():
    assert len(COMMANDS) >= 3 and any("container=pyxis" in c for c in COMMANDS), COMMANDS
    assert len(SWEEPS) >= 2, SWEEPS


def _dry_run(tmp_path, command: str) -> subprocess.CompletedProcess:
    over = site_file(tmp_path, "mysite", docs_site())
    argv = [a for a in shlex.split(command)[2:] if a != "dry_run=true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPWAY_")}
    env["WANDB_API_KEY"] = "k" * 40  # step 5 exports it
    return subprocess.run([sys.executable, "launch.py", *argv, *over[1:], "dry_run=true",
                           f"runs_root={tmp_path}/runs"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_plans_what_the_site_can_run(tmp_path, command):
    out = _dry_run(tmp_path, command)
    text = out.stdout
    assert "Slipway plan" in text, out.stderr
    codes = set(re.findall(r"^  - \[(\w+)\]", text, re.M))
    assert codes <= ELSEWHERE, text.split("PROBLEMS")[-1].split("-----")[0]
    assert "Warnings:" not in text, text.split("Warnings:")[1].split("\n\n")[0]
    scripts = dict(re.findall(r"----- (\w+) job script -----\n(.*?)(?=\n----- |\Z)", text, re.S))
    train = scripts.pop("train")
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", train)[1])
    assert 1 <= nodes <= 2 and "#SBATCH --gpus-per-node=4" in train and "#SBATCH --ntasks-per-node=4" in train
    assert "#SBATCH --partition=gpu" in train and "export NCCL_DEBUG=WARN" in train
    assert "export NCCL_SOCKET_IFNAME=ib0" in train
    for name, script in scripts.items():
        if name in ("preprocess", "corpus", "convert"):
            assert "#SBATCH --partition=cpu" in script and "#SBATCH --time=240" in script, name
            assert "--gpus-per-node" not in script, name


@pytest.mark.parametrize("command", SWEEPS)
def test_each_sweep_plans_every_point_on_the_site_and_writes_nothing(tmp_path, command):
    """The page's sweeps as dry runs: one plan per point of the lists' product, each on the site's 4-GPU
    nodes, one summary with the device-hours of every point and the total, no problem but this machine's
    and a global batch the layout cannot split (the page's third sweep shows it: 100), nothing written."""
    lists = [a.split("=", 1)[1].split(",") for a in shlex.split(command)[2:] if "=" in a and "," in a]
    points = prod(len(values) for values in lists)
    out = _dry_run(tmp_path, command)
    text = out.stdout
    summary = text[text.index("Slipway sweep"):] if "Slipway sweep" in text else ""
    assert re.search(rf"Slipway sweep \S+: {points} point\(s\)\n", summary), \
        (text[-3000:], out.stderr[-2000:])
    assert re.search(rf"\n  total: [\d.]+ device-hours for {points} point\(s\)\n", summary), summary
    assert "dry run: nothing was written or submitted" in summary and not (tmp_path / "runs").exists()
    # One point's plan in full (its scripts on the site's 4-GPU nodes), the others a line each.
    assert text.count("#SBATCH --gpus-per-node=4") == 1 and "--gpus-per-node=8" not in text
    assert set(re.findall(r"^    - \[(\w+)\]", summary, re.M)) <= ELSEWHERE  # every point's problems
    rows = re.split(r"\n  point \d+: ", summary.split("\n  total:")[0])[1:]
    assert len(rows) == points, summary
    for row in rows:
        codes = set(re.findall(r"^        - \[(\w+)\]", row, re.M))
        batch = "train.global_batch_size=100 " in row
        assert codes - ELSEWHERE == ({"batch"} if batch else set()), row
        assert re.search(r"[\d.]+ device-hours, ETA ", row), row
    assert out.returncode == (2 if "PROBLEMS" in summary else 0), out.stderr[-3000:]

"""The plan asks Slurm's accounting whether cluster.account and cluster.qos are the user's
(orchestrator/world/accounting.py, checks/slurm.py account_problems): a misspelled one is a problem with
the user's own as the fix; where accounting does not answer, a note in the plan's warnings.

The rules run against recorded sacctmgr answers (stand-in commands on PATH); the devcluster, which runs
slurmdbd, answers for real (its root user's association: account root, QoS normal, as `sacctmgr add
cluster` makes it), and its own sacctmgr with accounting switched off gives the note.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.base.plan_types import Context
from orchestrator.checks.slurm import account_problems
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.world.accounting import Association, parse, user_name
from tests.orchestrator.conftest import compose_cfg

# `sacctmgr -n -P show associations where user=U cluster=C format=account,partition,qos` at a site: two
# accounts, one of them only on the gpu partition.
RECORDED = """proj_ml||normal,high
proj_gpu|gpu|normal,gpu_long
"""
# What sacctmgr 22.05 says with AccountingStorageType=accounting_storage/none (stderr, exit 1), and with
# slurmdbd down: recorded on the devcluster.
ACCOUNTING_OFF = ("You are not running a supported accounting_storage plugin\n"
                  "Only 'accounting_storage/slurmdbd' is supported.\n")
DBD_DOWN = ("sacctmgr: error: slurm_persist_conn_open_without_init: failed to open persistent connection to "
            "host:127.0.0.1:6819: Connection refused\nsacctmgr: error: Sending PersistInit msg: Connection "
            "refused\n")


def _stand_ins(tmp_path: Path, monkeypatch, sacctmgr: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "sacctmgr.args"
    for name, body in (("sacctmgr", f'echo "$@" >> {log}\n{sacctmgr}'),
                       ("scontrol", "echo 'ClusterName             = site'\n")):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log


def _answers(tmp_path: Path, monkeypatch, text: str = RECORDED) -> Path:
    return _stand_ins(tmp_path, monkeypatch, f"cat <<'EOF'\n{text}EOF")


def _check(tmp_path: Path, *overrides: str):
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=slurm", "cluster.partition=gpu",
                       f"runs_root={tmp_path}/runs", *overrides])
    plan = make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1"), exists=lambda p: True)
    return {p.code: p for p in account_problems(Context(cfg, plan=plan))}, plan


def test_recorded_associations_parse():
    assert parse(RECORDED + "\n") == [Association("proj_ml", "", ("normal", "high")),
                                      Association("proj_gpu", "gpu", ("normal", "gpu_long"))]
    assert parse("Proj_X||Normal\n") == [Association("proj_x", "", ("normal",))]  # Slurm keeps lower case


def test_the_users_own_account_and_qos_pass_and_sacctmgr_is_asked_for_this_user_and_cluster(tmp_path,
                                                                                            monkeypatch):
    log = _answers(tmp_path, monkeypatch)
    for extra in (["cluster.account=proj_ml", "cluster.qos=high"], ["cluster.account=PROJ_GPU"],
                  ["cluster.qos=gpu_long"], ["cluster.account=proj_gpu", "cluster.qos=gpu_long"]):
        assert _check(tmp_path, *extra)[0] == {}, extra
    assert f"where user={user_name()} cluster=site format=account,partition,qos" in log.read_text()


def test_a_misspelled_account_is_refused_with_the_users_accounts(tmp_path, monkeypatch):
    _answers(tmp_path, monkeypatch)
    p = _check(tmp_path, "cluster.account=proj_mll")[0]["account"]
    assert str(p) == (f"[account] cluster.account='proj_mll': no association for user {user_name()} with "
                      "this account (sacctmgr); yours: proj_gpu, proj_ml. Fix: set "
                      "cluster.account=proj_ml"), str(p)


def test_an_account_of_another_partition_is_refused(tmp_path, monkeypatch):
    _answers(tmp_path, monkeypatch)
    p = _check(tmp_path, "cluster.account=proj_gpu", "cluster.stage_partition=cpu")[0]["account"]
    assert "for partition(s) gpu, not cpu" in p.message and "proj_ml" in p.fix, str(p)


def test_a_misspelled_qos_is_refused_with_the_associations_qos(tmp_path, monkeypatch):
    _answers(tmp_path, monkeypatch)
    p = _check(tmp_path, "cluster.account=proj_ml", "cluster.qos=hihg")[0]["qos"]
    assert str(p) == (f"[qos] cluster.qos='hihg': is not a QoS of user {user_name()}'s association with "
                      "account proj_ml (sacctmgr): high, normal. Fix: set cluster.qos=high"), str(p)
    assert "qos" in _check(tmp_path, "cluster.account=proj_ml", "cluster.qos=gpu_long")[0]  # proj_gpu's only


@pytest.mark.parametrize("answer,why", [
    (f"cat >&2 <<'EOF'\n{ACCOUNTING_OFF}EOF\nexit 1", "You are not running a supported accounting_storage"),
    (f"cat >&2 <<'EOF'\n{DBD_DOWN}EOF\nexit 1", "failed to open persistent connection"),
    (None, "sacctmgr is not on this node's PATH"),
])
def test_where_accounting_does_not_answer_the_plan_says_so(tmp_path, monkeypatch, answer, why):
    if answer is None:
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    else:
        _stand_ins(tmp_path, monkeypatch, answer)
    problems, plan = _check(tmp_path, "cluster.account=proj_mll")
    assert problems == {}
    [note] = [w for w in plan.warnings if "not checked" in w]
    assert note.startswith("cluster.account=proj_mll not checked: Slurm's accounting did not answer"), note
    assert why in note


def test_nothing_is_asked_without_an_account_or_qos_or_off_slurm(tmp_path, monkeypatch):
    log = _answers(tmp_path, monkeypatch)
    assert _check(tmp_path)[0] == {}
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=local"])
    assert account_problems(Context(cfg)) == [] and not log.exists()


# ----- on the devcluster (slurmdbd) ----------------------------------------------------------------------


def _devcluster(tmp_path: Path, *overrides: str):
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=devcluster", f"runs_root={tmp_path}/runs",
                       *overrides])
    plan = make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1"), exists=lambda p: True)
    return {p.code: p for p in account_problems(Context(cfg, plan=plan))}, plan


@pytest.mark.slurm
def test_the_devclusters_accounting_knows_the_users_associations(tmp_path):
    from orchestrator.world.accounting import associations

    mine = associations(user_name())
    assert isinstance(mine, list) and mine, mine  # `sacctmgr add cluster` gave the user one
    account = mine[0].account
    qos = mine[0].qos[0]
    assert _devcluster(tmp_path, f"cluster.account={account}", f"cluster.qos={qos}")[0] == {}
    problems = _devcluster(tmp_path, f"cluster.account={account}x", f"cluster.qos={qos}")[0]
    assert f"yours: {', '.join(sorted({a.account for a in mine}))}" in problems["account"].message
    problems = _devcluster(tmp_path, f"cluster.account={account}", f"cluster.qos={qos}_typo")[0]
    assert problems["qos"].fix == f"set cluster.qos={qos}", problems


@pytest.mark.slurm
def test_the_devclusters_sacctmgr_with_accounting_off_gives_a_note(tmp_path, monkeypatch):
    """The devcluster's own slurm.conf with AccountingStorageType=accounting_storage/none: its real
    sacctmgr refuses, and the plan notes that the account was not checked."""
    conf = Path(os.environ["SLURM_CONF"])
    off = tmp_path / "slurm.conf"
    off.write_text("".join("AccountingStorageType=accounting_storage/none\n"
                           if line.startswith("AccountingStorageType=") else line
                           for line in conf.read_text().splitlines(keepends=True)))
    monkeypatch.setenv("SLURM_CONF", str(off))
    problems, plan = _devcluster(tmp_path, "cluster.account=nosuchaccount")
    assert problems == {}
    assert any("not checked" in w and "accounting_storage" in w for w in plan.warnings), plan.warnings

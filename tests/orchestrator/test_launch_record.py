"""One launch reads ``run.json`` through one record (launches.LaunchRecord) and renders its job scripts once.

Counted on a real ``flow.launch`` of the smoke run, first launch and relaunch, with only the job start itself
stood in for (local job ids that are never live processes): every ``open`` of run.json for reading and every
``os.replace`` onto it. The writes are the crash-consistency protocol's (launches.py): the launch's record,
an intent before and a job id after each submission, the final state, and on a relaunch the earlier
launch's outcomes. Before the record, a launch read run.json 17 times (19 on a relaunch) and rendered every
script twice.
"""

from __future__ import annotations

import builtins
import io
import itertools
import os

from orchestrator.launch import flow, submit
from tests.orchestrator.conftest import compose_cfg
from trainer.run_files import RUN_JSON

READS = 3  # the run_record check, the launch number the scripts name (prepare), the record under the lock


def test_a_launch_reads_run_json_once_per_step_and_renders_once(tmp_path, monkeypatch):
    ids = itertools.count(4_000_000)  # above pid_max: never a live process, so the relaunch is allowed
    monkeypatch.setattr(submit, "_submit_job", lambda ex, fn, stage, local: (None, str(next(ids))))
    counts = {"read": 0, "write": 0, "render": 0}
    real_open, real_replace, real_render = builtins.open, os.replace, flow.render_stage

    def counting_open(file, mode="r", *args, **kwargs):
        counts["read"] += os.path.basename(str(file)) == RUN_JSON and mode.startswith("r")
        return real_open(file, mode, *args, **kwargs)

    def counting_replace(src, dst, *args, **kwargs):
        counts["write"] += os.path.basename(str(dst)) == RUN_JSON
        return real_replace(src, dst, *args, **kwargs)

    def counting_render(*args, **kwargs):
        counts["render"] += 1
        return real_render(*args, **kwargs)

    for target, name, fn in ((builtins, "open", counting_open), (io, "open", counting_open),
                             (os, "replace", counting_replace), (flow, "render_stage", counting_render)):
        monkeypatch.setattr(target, name, fn)
    cfg = ["+experiment=codeparrot_smoke", "run_id=r1", f"runs_root={tmp_path / 'runs'}",
           f"cache_dir={tmp_path / 'cache'}", "wait=false"]
    for relaunch in (0, 1):
        counts.update(read=0, write=0, render=0)
        result = flow.launch(compose_cfg(cfg), out=io.StringIO())
        stages = len(result.plan.stages)
        assert [s.action for s in result.submitted] == ["submitted"] * stages
        assert counts == {"read": READS, "write": 1 + 2 * stages + 1 + relaunch, "render": stages}, (
            relaunch, counts)

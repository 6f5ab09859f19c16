"""Offline clusters just work: real wandb in online mode, pointed at an address nothing answers on, trains
the run offline after one bounded probe and one warning; the summary and status name the `wandb sync`
command; ``require_online`` makes the same situation a permanent (never retried) error."""

import json
import os
import re
import socket
from pathlib import Path

import pytest

from orchestrator.readback.goodput import goodput_notes
from orchestrator.readback.status import collect, format_rows
from orchestrator.readback.summary import write_summary
from tests.logs import captured
from tests.train import wandb_reader
from tests.train.harness import run_cfg, tiny_config, write_dataset
from tests.waits import NEVER_S
from trainer import wandb_online
from trainer.run_files import RUN_JSON
from trainer.signals import EXIT_OK, EXIT_REQUEUE, permanent_reason


def _closed_port() -> int:
    """A local port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "slipway-fake-key-" + "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(proxy, raising=False)


def _record_train_job(run_dir: str) -> None:
    """The run.json of a run whose train job was a (finished) local job, for summary and status."""
    entry = {"job_id": "2147483647", "executor": "local", "folder": run_dir, "state_dir": run_dir}
    with open(os.path.join(run_dir, RUN_JSON), "w", encoding="utf-8") as f:
        json.dump({"jobs": {"train": [entry]}}, f)


def test_online_without_a_route_trains_offline_after_one_bounded_probe(tmp_path, unreachable):
    data = write_dataset(str(tmp_path / "data"))
    run_dir = str(tmp_path / "run")
    d = tiny_config(run_dir, data, run_id="offline-1", train={"iters": 6, "log_interval": 2},
                    logging={"wandb": {"mode": "online", "project": "p"}})
    with captured("slipway.trainer.run.metrics") as lines:
        r = run_cfg(d)
    assert r.exit_code == EXIT_OK and r.iteration == 6 and r.wandb_run_id == "offline-1"
    warnings = [x for x in lines if "unreachable" in x]
    assert len(warnings) == 1, lines  # one warning line, naming the address and the way out
    assert os.environ["WANDB_BASE_URL"] in warnings[0] and "wandb sync" in warnings[0]
    took = re.search(r"probe took ([0-9.]+) s, bounded at ([0-9.]+) s", warnings[0])
    assert took and float(took.group(2)) <= 10 and float(took.group(1)) <= float(took.group(2)) + 1

    files = wandb_reader.run_files(run_dir)  # W&B's own offline files, with every logged step
    assert len(files) == 1 and "offline-run-" in files[0], files
    assert [row["_step"] for row in wandb_reader.history(files[0])] == [2, 4, 6]
    sync = f"wandb sync {os.path.dirname(files[0])}"
    _record_train_job(run_dir)
    assert sync in write_summary(run_dir)
    status = format_rows(collect(run_dir))
    assert f"W&B: run run: W&B is unreachable from this node ({os.environ['WANDB_BASE_URL']}" in status
    assert sync in status


def test_require_online_makes_unreachable_a_permanent_error(tmp_path, unreachable):
    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 2},
                    logging={"wandb": {"mode": "online", "require_online": True}})
    with pytest.raises(wandb_online.WandbError, match="require_online=true") as err:
        run_cfg(d)
    assert "W&B is unreachable" in permanent_reason(err.value)  # the job stops instead of retrying
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_the_probe_is_bounded_when_the_server_never_answers():
    """A server that accepts the connection and then stays silent (a firewall that drops replies)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # the kernel completes the handshake; nobody ever reads or answers
        p = wandb_online.probe(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
    assert p.reason is not None and p.elapsed_s < 10, p


def test_a_server_that_answers_with_an_error_is_reachable():
    """401/404 mean W&B is there (the key or the path is another matter): stay online."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_error(401)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        p = wandb_online.probe(f"http://127.0.0.1:{server.server_port}", timeout_s=10)
    finally:
        server.server_close()
    assert p.reason is None, p


def _children(pid: int) -> list[int]:
    out = []
    for stat in os.listdir("/proc"):
        try:
            with open(f"/proc/{stat}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat.isdigit() and int(fields[1]) == pid:  # fields[1]: the parent's pid
            out.append(int(stat))
    return out


def test_a_cancel_that_also_kills_the_wandb_service_ends_quietly(tmp_path):
    """scancel signals the whole job: the trainer and W&B's service process. The trainer still saves and
    exits 75, and W&B's teardown prints no traceback (no ConnectionResetError at exit)."""
    import signal
    import subprocess
    import sys

    import yaml

    data = write_dataset(str(tmp_path / "data"))
    forever = {"iters": 10**5, "log_interval": 1, "save_interval": 10**5}
    d = tiny_config(str(tmp_path / "run"), data, train=forever,
                    logging={"wandb": {"mode": "offline"}})
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(d))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trainer.run", "--config", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:  # until W&B has logged a few steps
        lines.append(line)
        if re.search(r"iteration\s+3/", line):
            break
    for pid in [proc.pid, *_children(proc.pid)]:  # W&B's service runs in a session of its own; Slurm
        os.kill(pid, signal.SIGTERM)  # signals every process of the job step (its cgroup) all the same
    rest, _ = proc.communicate(timeout=NEVER_S)
    out = "".join(lines) + rest
    assert proc.returncode == 75, out
    assert "Traceback" not in out, out


def _stop_at(iteration: int):
    """A requeue as the batch script sees one: SIGUSR2 (Slurm's time-limit signal) after ``iteration``; the
    trainer saves and exits 75."""
    import signal

    from trainer.run import RunHooks

    def on_step(it: int, loss: float) -> None:
        if it == iteration:
            os.kill(os.getpid(), signal.SIGUSR2)

    return RunHooks(on_step=on_step)


def _setup_floor() -> str:
    """The wandb floor setup.py pins (``wandb>=X``)."""
    text = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    return re.search(r'"wandb>=([0-9.]+)"', text).group(1)


def test_a_requeued_runs_offline_folders_are_all_listed_and_uploaded_by_one_command(tmp_path):
    """Two jobs of one run (the first requeued by a signal, the second resuming) leave two offline folders
    of one W&B run id; status and the summary list both in one ``wandb sync`` command, which the real
    wandb accepts (a dry run: no server is reachable here) and documents as uploading them in start order."""
    import shlex
    import subprocess
    import sys

    import wandb

    data = write_dataset(str(tmp_path / "data"))
    run_dir = str(tmp_path / "run")
    d = tiny_config(run_dir, data, run_id="requeued-1", train={"iters": 4, "log_interval": 1},
                    logging={"wandb": {"mode": "offline", "project": "p"}})
    assert run_cfg(d, _stop_at(2)).exit_code == EXIT_REQUEUE
    assert run_cfg(d).iteration == 4  # the requeued job resumes from the checkpoint the stop saved
    wandb.teardown()
    files = wandb_reader.run_files(run_dir)
    dirs = [os.path.dirname(f) for f in files]
    assert len(dirs) == 2 and all(wandb_reader.run_ids(f) == {"requeued-1"} for f in files), files
    _record_train_job(run_dir)
    status = format_rows(collect(run_dir))
    line = next((x for x in status.splitlines() if x.startswith("W&B: run run: ")), "")
    command = f"wandb sync {dirs[0]} {dirs[1]}"  # oldest first; every folder, no --append
    assert line == f"W&B: run run: logged offline in 2 folder(s), upload with: {command}", status
    summary = write_summary(run_dir)
    assert command in summary
    # Goodput over both attempts: in W&B (the resumed job's rows), status and the summary alike.
    last = wandb_reader.history(files[1])[-1]
    assert last["goodput/attempts"] == 2 and 0 < last["goodput/fraction"] < 1, last
    assert last["goodput/lost_checkpoint_s"] > 0 and last["goodput/lost_startup_s"] > 0, last
    [note] = [x for x in goodput_notes(run_dir) if x.startswith("GOODPUT: run run: goodput ")]
    assert "(2 attempts, 1 allocation)" in note, note
    assert "  goodput          goodput " in summary and "(2 attempts, 1 allocation)" in summary, summary
    # The printed command as it reads, run by this interpreter's wandb (``python -m wandb``: the `wandb`
    # script of make's venv need not be on PATH).
    words = shlex.split(line.split("upload with: ", 1)[1])
    assert words[:2] == ["wandb", "sync"]
    dry = subprocess.run([sys.executable, "-m", *words, "--dry-run"], capture_output=True, text=True,
                         timeout=NEVER_S, cwd=tmp_path)
    said = dry.stdout + dry.stderr
    assert dry.returncode == 0 and "Would sync 2 run(s)" in said, said
    assert all(os.path.basename(x) in said for x in dirs), said
    # What the command relies on, in the installed client's own words, and the floor that promises it.
    helptext = " ".join(subprocess.run([sys.executable, "-m", "wandb", "sync", "--help"], capture_output=True,
                                       text=True, timeout=NEVER_S).stdout.split())
    assert "synced sequentially in order of start time" in helptext and "resumed runs" in helptext, helptext
    floor = tuple(int(x) for x in _setup_floor().split("."))
    assert floor >= (0, 28, 1) and tuple(int(x) for x in wandb.__version__.split(".")[:3]) >= floor

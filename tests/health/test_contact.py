"""Which node lost contact (trainer/health/contact.py): the probe on real sockets (an accepted and a
refused connection are answers; a name that does not resolve is not), the verdict from each side of a cut
(two nodes with the login node as witness, two without, three), and the watchdog naming the node when
every rank's heartbeat is fresh (a cut link). The cut itself, across devcluster nodes:
tests/orchestrator/test_multinode.py."""

from __future__ import annotations

import faulthandler
import json
import socket

import pytest

from trainer import health
from trainer.health import HealthConfig, Monitor, contact, heartbeat_path, read_bad_nodes, read_hangs
from trainer.health.contact import Answer, lost_contact, probe
from trainer.run_files import RunDir

SLURM = {"SLURM_STEP_NODELIST": "n[1-2]", "MASTER_PORT": "20001", "SLURM_SUBMIT_HOST": "login"}


def test_an_accepted_or_refused_connection_is_an_answer_an_unresolvable_name_is_not():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probe("localhost", port) == Answer("localhost", "127.0.0.1", True, "connected")
    assert probe("127.0.0.1", port) == Answer("127.0.0.1", "127.0.0.1", True, "refused")  # closed now
    gone = probe("slipway-no-such-host.invalid", port, timeout_s=1)
    assert not gone.answered and gone.why.startswith("does not resolve"), gone


def _network(monkeypatch, me: str, silent: set[str]) -> None:
    """This process is node ``me``; the hosts in ``silent`` do not answer, every other one refuses."""
    monkeypatch.setenv("SLIPWAY_NODE_NAME", me)
    def answer(host: str, port: int, timeout_s: float) -> Answer:
        quiet = host in silent
        return Answer(host, f"10.0.0.{len(host)}", not quiet, "no answer within 3 s" if quiet else "refused")

    monkeypatch.setattr(contact, "probe", answer)


def test_two_nodes_and_a_witness_name_the_cut_node_from_either_side(monkeypatch):
    _network(monkeypatch, "n1", {"n2"})  # the healthy side: n2 silent, the login node answers
    named, look = lost_contact(SLURM)
    assert named == {"n2": "node n2 lost contact: node n1 got no answer from it (no answer within 3 s) while "
                           "login answered"}, named
    assert look == "node n1 asked n2 (10.0.0.2: no answer within 3 s), login (10.0.0.5: refused)"
    _network(monkeypatch, "n2", {"n1", "login"})  # the cut side: nobody answers
    named, _ = lost_contact(SLURM)
    assert named == {"n2": "node n2 lost contact: it reached none of n1, login"}, named


def test_without_a_third_host_two_nodes_cannot_tell_which_side_is_cut(monkeypatch):
    _network(monkeypatch, "n1", {"n2"})
    named, look = lost_contact({k: v for k, v in SLURM.items() if k != "SLURM_SUBMIT_HOST"})
    assert named == {} and "no third host to tell which side is cut off" in look, look


def test_with_three_nodes_the_silent_one_is_named(monkeypatch):
    _network(monkeypatch, "n1", {"n3"})
    env = {"SLURM_STEP_NODELIST": "n[1-3]", "MASTER_PORT": "20001"}
    assert list(lost_contact(env)[0]) == ["n3"]
    _network(monkeypatch, "n1", set())
    assert lost_contact(env)[0] == {}  # everyone answers: no network fault to name


def test_outside_a_multi_node_step_nothing_is_asked(monkeypatch):
    monkeypatch.setenv("SLIPWAY_NODE_NAME", "n1")
    monkeypatch.setattr(contact, "probe", lambda *a: pytest.fail("probed"))
    assert lost_contact({}) == ({}, "")
    assert lost_contact({"SLURM_STEP_NODELIST": "n1", "MASTER_PORT": "1"}) == ({}, "")


def test_the_watchdog_names_the_node_that_lost_contact_when_every_heartbeat_is_fresh(
        tmp_path, monkeypatch):
    """Both ranks alive at the same iteration (a cut link leaves them so): no heartbeat culprit, so the
    watchdog asks the network, names the node in its line, the hang record and the bad-node record."""
    run = str(tmp_path)
    RunDir(run).heartbeats.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    peer = Monitor(HealthConfig(heartbeat_interval_s=0.1, hang_timeout_s=5), run)
    peer.rank, peer.world_size, peer.host, peer.iteration, peer.phase = 1, 2, "n2", 5, "train"
    peer.write()  # rank 1's heartbeat: fresh, same iteration
    me = Monitor(HealthConfig(heartbeat_interval_s=0.1, hang_timeout_s=5), run)
    me.rank, me.world_size, me.host, me.iteration, me.phase = 0, 2, "n1", 5, "train"
    me.write()
    why = "node n2 lost contact: node n1 got no answer from it (no answer within 3 s) while login answered"
    monkeypatch.setattr(health, "lost_contact", lambda: ({"n2": why}, "node n1 asked n2, login"))

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(health.os, "_exit", exit_)
    try:
        with pytest.raises(SystemExit) as ended:
            me._fire(5.2)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert ended.value.code == 70
    beat = json.loads(open(heartbeat_path(run, 0)).read())  # with the watchdog's line
    assert beat["phase"] == "hung", beat
    assert f"at iteration 5, phase train; {why} (node n1 asked n2, login). This rank, rank 0 of 2 (host n1" \
        in beat["message"], beat
    assert [h["lost_contact"] for h in read_hangs(run)] == [{"n2": why}]
    named = read_bad_nodes(run)
    assert [(n["node"], n["source"], n["job"]) for n in named] == [("n2", "watchdog", "77")], named
    assert "node n2 lost contact" in named[0]["why"] and "at iteration 5" in named[0]["why"]

"""The preflight's look at the rendezvous before any process group (trainer/health/rendezvous.py): a
MASTER_ADDR that does not resolve, answers with a refusal, does not answer, is loopback in a multi-node job
or is not rank 0's own address is named within ``preflight_timeout_s`` (scaled down here), not after the
process group's 30 minutes; a socket interface the node lacks is named with the node's interfaces; the
trainer runs the check before its rendezvous (a real two-rank start with a MASTER_ADDR that does not
resolve ends in the preflight's line). The devcluster test of the same across nodes is in
tests/orchestrator/test_multinode.py."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.ci import skip_unless_ci
from tests.waits import NEVER_S
from trainer.health import HealthConfig
from trainer.health.rendezvous import (
    Rendezvous,
    RendezvousError,
    check_rendezvous,
    describe_sockets,
    interface_address,
    nccl_matches,
)

FAST = HealthConfig(preflight_timeout_s=1.0)


def _rv(rank: int, addr: str, port: int = 1, world: int = 2, backend: str = "gloo") -> Rendezvous:
    return Rendezvous(rank, world, addr, port, backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_master_addr_that_does_not_resolve_is_named_with_the_node(monkeypatch):
    monkeypatch.setenv("SLIPWAY_NODE_NAME", "nodeB")
    with pytest.raises(RendezvousError) as err:
        check_rendezvous(FAST, _rv(1, "slipway-no-such-host.invalid"), environ={})
    msg = str(err.value)
    assert msg.startswith("preflight: MASTER_ADDR=slipway-no-such-host.invalid does not resolve on node "
                          "nodeB (rank 1"), msg


def test_a_refusing_master_addr_is_named_after_the_preflight_timeout():
    port = _free_port()  # nothing listens there: the host answers with a refusal
    with pytest.raises(RendezvousError) as err:
        check_rendezvous(FAST, _rv(1, "127.0.0.1", port), environ={})
    msg = str(err.value)
    assert f"got no connection from the rendezvous MASTER_ADDR=127.0.0.1:{port} (127.0.0.1) within 1 s " \
           "(train.preflight_timeout_s): refused: the host answers but nothing listens there" in msg, msg


NO_ROUTE = r"""
import sys
from trainer.health import HealthConfig
from trainer.health.rendezvous import Rendezvous, check_rendezvous
rv = Rendezvous(1, 2, "198.51.100.7", 29500, "gloo")
check_rendezvous(HealthConfig(preflight_timeout_s=1.0), rv, environ={})
"""


def test_a_master_addr_that_does_not_answer_is_named():
    """From a network namespace of its own (no route anywhere, as a node cut off from the others): the
    address gets no answer at all, which is not a refusal."""
    res = subprocess.run(["unshare", "--net", sys.executable, "-c", NO_ROUTE], capture_output=True, text=True,
                         timeout=NEVER_S)
    if "unshare failed" in res.stderr or "Operation not permitted" in res.stderr:
        skip_unless_ci(f"no network namespace for the test: {res.stderr.strip()}")
    assert res.returncode == 1, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "got no connection from the rendezvous MASTER_ADDR=198.51.100.7:29500 (198.51.100.7) within 1 s " \
           "(train.preflight_timeout_s): Network is unreachable: no route or a firewall" in last, last


def test_a_listening_rendezvous_passes_and_rank_0_must_own_the_address(caplog):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert check_rendezvous(FAST, _rv(1, "localhost", port), environ={}) == "127.0.0.1"
    assert check_rendezvous(FAST, _rv(0, "127.0.0.1", port), environ={}) == "127.0.0.1"
    with pytest.raises(RendezvousError, match=r"MASTER_ADDR=198.51.100.7 \(198.51.100.7\) is not an address "
                                              r"of node .*, where rank 0 runs its rendezvous store"):
        check_rendezvous(FAST, _rv(0, "198.51.100.7"), environ={})


def test_loopback_is_refused_only_when_the_job_spans_nodes():
    with pytest.raises(RendezvousError, match="resolves to the loopback address 127.0.0.1 on node .*: the "
                                              "job spans nodes"):
        check_rendezvous(FAST, _rv(1, "localhost", _free_port()), environ={"SLURM_JOB_NUM_NODES": "2"})
    with pytest.raises(RendezvousError, match="refused"):  # one node: loopback is fine, nobody listens
        check_rendezvous(FAST, _rv(1, "localhost", _free_port()), environ={"SLURM_JOB_NUM_NODES": "1"})


def test_a_socket_interface_the_node_lacks_is_named_with_its_interfaces(monkeypatch):
    monkeypatch.setenv("SLIPWAY_NODE_NAME", "nodeC")
    env = {"GLOO_SOCKET_IFNAME": "lo,slipway9"}
    with pytest.raises(RendezvousError) as err:
        check_rendezvous(FAST, _rv(1, "127.0.0.1"), environ=env)
    msg = str(err.value)
    assert "on node nodeC (rank 1): GLOO_SOCKET_IFNAME=lo,slipway9 names slipway9, which this node does " \
           "not have (its interfaces: lo" in msg and "cluster.env" in msg, msg
    nccl = {"NCCL_SOCKET_IFNAME": "=slipway9"}
    with pytest.raises(RendezvousError, match="NCCL_SOCKET_IFNAME==slipway9 matches none of this node's"):
        check_rendezvous(FAST, _rv(1, "127.0.0.1", backend="nccl"), environ=nccl)
    with pytest.raises(RendezvousError, match="refused"):  # gloo does not read NCCL's: past the interfaces
        check_rendezvous(FAST, _rv(1, "127.0.0.1", _free_port()), environ=nccl)


def test_nccl_interface_specs_read_as_nccl_reads_them():
    names = ["lo", "eth0", "eth1", "ib0", "docker0"]
    assert nccl_matches("eth", names) == ["eth0", "eth1"]  # prefixes
    assert nccl_matches("=eth", names) == []  # exact names
    assert nccl_matches("=eth1,ib0", names) == ["eth1", "ib0"]
    assert nccl_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]  # all but these prefixes


def test_the_socket_interfaces_are_described_with_their_addresses():
    assert interface_address("lo") == "127.0.0.1"
    text = describe_sockets({"GLOO_SOCKET_IFNAME": "lo"})
    assert text == "GLOO_SOCKET_IFNAME=lo (lo 127.0.0.1), NCCL_SOCKET_IFNAME unset", text


# Two ranks of the trainer's CLI path (init_distributed with the preflight's check before the rendezvous).
RANK = r"""
import sys
from trainer.config import RunConfig
from trainer.health.config import HealthConfig
from trainer.parallel import ParallelConfig
from trainer.parallel.launch import init_distributed
from trainer.run.entry import _rendezvous_check
cfg = RunConfig.from_dict({"train": {"preflight_timeout_s": 2}})
env = {"RANK": sys.argv[1], "WORLD_SIZE": "2", "MASTER_ADDR": "slipway-no-such-host.invalid",
       "MASTER_PORT": "29999"}
init_distributed(ParallelConfig(), backend="gloo", timeout_s=1800, before=_rendezvous_check(cfg), environ=env)
"""


def test_the_trainer_checks_the_rendezvous_before_waiting_on_it():
    """Without the check, the rank would wait in init_process_group for the group's 30 minutes (rank 1:
    rank 0 would fail the same way)."""
    res = subprocess.run([sys.executable, "-c", RANK, "1"], capture_output=True, text=True, timeout=NEVER_S)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "RendezvousError: preflight: MASTER_ADDR=slipway-no-such-host.invalid does not resolve on node" \
        in res.stderr, res.stderr[-2000:]

"""A rendezvous port another process holds: rank 0 says which port, where it came from and the fix."""

from __future__ import annotations

import socket

import pytest
import torch

from trainer.parallel import ParallelConfig
from trainer.parallel.launch import init_distributed


def test_a_taken_rendezvous_port_is_named_with_its_fix():
    threads = torch.get_num_threads()  # init_distributed shares this node's cores between its 2 ranks
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        try:
            with pytest.raises(RuntimeError) as err:
                init_distributed(ParallelConfig(), backend="gloo", timeout_s=20, environ=env)
        finally:
            torch.set_num_threads(threads)
    msg = str(err.value)
    assert f"rendezvous port {port} on 127.0.0.1 is held by another process" in msg, msg
    assert "cluster.env.MASTER_PORT" in msg and "ip_local_port_range" in msg, msg
    assert "EADDRINUSE" in str(err.value.__cause__)

"""Which node lost contact: asked when the hang watchdog fires and the heartbeats show no culprit
(torch-free).

A cut link (a node's interface down, its traffic dropped) leaves every rank alive: each keeps writing its
heartbeat, and each waits in the same collective for a peer it cannot reach. The heartbeats cannot say
who is cut off; the network can. Every firing rank of a multi-node Slurm job looks, at once and for at most
``PROBE_S``, at each other node of its step and at the host the job was submitted from (the witness: a
login node every healthy compute node reaches): a TCP connection to the rendezvous port there that is
accepted or refused means the host answered; a timeout or an unreachable network means it did not.

- A node that answers nobody (no other node, no witness) judges itself cut off.
- A node that reaches the witness or some nodes names the nodes it cannot reach.
- Two nodes and no witness to ask: no one can tell which side is cut; no node is named.

A cut node and the healthy ones so name the same node, and the batch script keeps it out of the job's next
allocation (trainer/health/badnodes.py, orchestrator/render.py).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.health.heartbeat import expand_hostlist, node_name

PROBE_S = 3.0


@dataclass(frozen=True)
class Answer:
    host: str
    address: str  # what the name resolved to ('' when it did not)
    answered: bool
    why: str  # 'connected', 'refused', or the failure


def probe(host: str, port: int, timeout_s: float = PROBE_S) -> Answer:
    """Whether ``host`` answers a TCP connection on ``port`` (accepted or refused) within ``timeout_s``."""
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        return Answer(host, "", False, f"does not resolve ({e.strerror or e})")
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return Answer(host, address, True, "connected")
    except ConnectionRefusedError:
        return Answer(host, address, True, "refused")
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        return Answer(host, address, False, why)


def _probe_all(hosts: list[str], port: int, timeout_s: float) -> dict[str, Answer]:
    """Every host at once (threads): the look takes one timeout, not one per host."""
    out: dict[str, Answer] = {}
    threads = [threading.Thread(target=lambda h=h: out.__setitem__(h, probe(h, port, timeout_s)), daemon=True)
               for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return {h: out.get(h, Answer(h, "", False, "probe did not finish")) for h in hosts}


def _describe(answers: list[Answer]) -> str:
    return ", ".join(f"{a.host} ({a.address or '?'}: {a.why})" for a in answers)


def lost_contact(environ: Mapping[str, str] | None = None, timeout_s: float = PROBE_S
                 ) -> tuple[dict[str, str], str]:
    """({node: why} for the nodes that lost contact, a one-line account of the look), as seen from this
    node (the module doc); ({}, '') outside a multi-node Slurm step."""
    env = os.environ if environ is None else environ
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
    me = node_name()
    others = [n for n in dict.fromkeys(nodes) if n != me]
    port = int(env.get("MASTER_PORT", "0") or 0)
    if not others or not port:
        return {}, ""
    witness = env.get("SLURM_SUBMIT_HOST", "").split(".")[0]
    witness = witness if witness and witness not in nodes else ""
    answers = _probe_all(others + ([witness] if witness else []), port, timeout_s)
    silent = [answers[n] for n in others if not answers[n].answered]
    heard = [a for a in answers.values() if a.answered]
    look = f"node {me} asked {_describe(list(answers.values()))}"
    if not silent:
        return {}, look
    if not heard:
        if len(others) == 1 and not witness:
            return {}, f"{look}: no answer between {me} and {others[0]}, and no third host to tell which " \
                       "side is cut off"
        return {me: f"node {me} lost contact: it reached none of {', '.join(answers)}"}, look
    reached = ", ".join(a.host for a in heard)
    return {a.host: f"node {a.host} lost contact: node {me} got no answer from it ({a.why}) while "
                    f"{reached} answered" for a in silent}, look

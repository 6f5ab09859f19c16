"""slurm.conf and slurmdbd.conf for the devcluster.

Choices that matter (and why). The cluster is as strict as a real site where that costs nothing:
- Every node is a host of its own (hosts.py): slurmd (``slurmd -N <node>``) runs in the node's network,
  UTS and mount namespaces, at its own address on the cluster's bridge (``NodeAddr``, ``NodeHostname`` the
  node's name). slurmctld and slurmdbd listen on the bridge's address on this machine, which the nodes
  reach; the nodes resolve each other's names through the cluster's hosts file (torch.distributed uses
  the first node's name as MASTER_ADDR). In the lenient ``single-host`` mode every node is this host
  (127.0.0.1, its names in /etc/hosts).
- Three partitions: ``cpu`` (default; n1, n2), ``gpu`` (g1, g2), whose nodes carry ``gres/gpu`` on files
  the cluster makes (``gres.conf File=``): Slurm counts and assigns them and sets CUDA_VISIBLE_DEVICES and
  SLURM_JOB_GPUS, and refuses a request for more than a node has; and ``spare`` (n1, n2, n3), where a
  two-node job has a node to move to.
- Every node declares this machine's real sockets, cores and threads (machine.py): tasks are bound to the
  cores they were given (``task/affinity``, ``autobind=cores``; since Slurm 22.05 srun must be told
  ``--cpus-per-task``, or each task gets one core).
- Memory is a consumable resource (``CR_Core_Memory``, ``DefMemPerCPU``): a job gets what it asks for,
  and a node's RealMemory caps what runs on it at once.
- Where the machine allows cgroup v1 (machine.cgroup_problem), ``task/cgroup`` also confines each job to
  its CPUs and memory and ``proctrack/cgroup`` tracks its processes; elsewhere ``task/affinity`` with
  ``proctrack/linuxproc``, and ``status`` says why.
- Short KillWait/MinJobAge/cred_expire and JobRequeue=1 so requeue/cancel tests are quick (a requeued
  job waits cred_expire seconds before it may start again).
- ``--signal=SIG@T`` works as on any Slurm: slurmctld checks deadlines every 30 s and sends up to 30 s early.
- Nodes as hosts: each slurmd listens inside its node (which has only the node's addresses), slurmctld and
  slurmdbd on every address of this machine (the nodes reach them at the bridge's; MUNGE authenticates
  every message), MariaDB on loopback. Single host: everything on loopback (``NoCtldInAddrAny,NoInAddrAny``).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from .hosts import bridge_address, node_addresses
from .layout import (
    CLUSTER_NAME,
    CTLD,
    DBD,
    MYSQL,
    NODE_SPECS,
    PARTITIONS,
    PORT_RANGE,
    PORT_STEP,
    SLURMD0,
    Layout,
    Settings,
)
from .machine import Machine

LOOPBACK = "127.0.0.1"
CRED_EXPIRE_S = 10
# Memory a job gets per allocated CPU when it does not say (--mem): real sites set one, and without it a
# job would be given the whole node's memory.
DEF_MEM_PER_CPU_MB = 2048
NVIDIA_MAJOR = 195  # the character-device major of /dev/nvidia<N>
# Job ids per cluster: 300 port blocks x 200000 stays below Slurm's largest job id (0x03ff0000).
JOB_ID_BLOCK = 200_000


def user() -> str:
    """The account every daemon runs as (root on CI; slurmd then runs jobs as their submitter)."""
    return pwd.getpwuid(os.geteuid()).pw_name


def binding(machine: Machine) -> list[str]:
    """How jobs are confined: cgroups and affinity where the machine allows cgroups, affinity alone else.
    Tasks are bound to cores by default (autobind=cores, as many sites set): a step that does not say how
    many CPUs its tasks have (srun without --cpus-per-task, since Slurm 22.05) gets one core per task."""
    bind = "TaskPluginParam=autobind=cores"
    if machine.cgroups:
        return ["ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity", bind]
    return ["ProctrackType=proctrack/linuxproc", "TaskPlugin=task/affinity", bind]


# Each partition's time limit, as a site has one (the plan refuses a longer job: checks/slurm.py).
MAX_TIME = {"cpu": "1-00:00:00", "gpu": "12:00:00"}


def controller_address(settings: Settings) -> str:
    """Where slurmctld and slurmdbd listen: the bridge's address, which the nodes reach (loopback when every
    node is this host)."""
    return bridge_address(settings.subnet) if settings.hosts else LOOPBACK


def node_lines(settings: Settings, hostname: str, machine: Machine) -> list[str]:
    shape = (f"CPUs={machine.cpus} Boards=1 SocketsPerBoard={machine.sockets} "
             f"CoresPerSocket={machine.cores_per_socket} ThreadsPerCore={machine.threads_per_core} "
             f"RealMemory={machine.memory_mb}")
    addresses = node_addresses(settings.subnet) if settings.hosts else {}
    lines = []
    for i, node in enumerate(NODE_SPECS):
        gres = f" Gres=gpu:{node.gpus}" if node.gpus else ""
        where = (f"NodeHostname={node.name} NodeAddr={addresses[node.name]}" if settings.hosts
                 else f"NodeHostname={hostname} NodeAddr={LOOPBACK}")
        lines.append(f"NodeName={node.name} {where} Port={settings.port(SLURMD0 + i)} {shape}{gres} "
                     "State=UNKNOWN")
    for k, (part, members) in enumerate(PARTITIONS.items()):
        lines.append(f"PartitionName={part} Nodes={','.join(members)} Default={'YES' if k == 0 else 'NO'} "
                     f"MaxTime={MAX_TIME.get(part, 'INFINITE')} State=UP OverSubscribe=NO")
    return lines


def communication(settings: Settings) -> list[str]:
    """Nodes as hosts: slurmctld, and srun on this machine, listen on any address, so that the nodes reach
    them through the bridge (NoCtldInAddrAny/NoInAddrAny bind to what this host's name resolves to,
    127.0.0.1 here); each slurmd listens inside its own node, which has only that node's addresses. A
    single host: everything on loopback."""
    return [] if settings.hosts else ["CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"]


def job_ids(settings: Settings) -> tuple[int, int]:
    """(FirstJobId, MaxJobId): a range of its own per cluster (from its port block). Two clusters on one
    machine both have a node n1, and Slurm 22.05 puts a job's cgroup at /slurm_n1/uid_<uid>/job_<id>
    whatever the cluster: distinct job ids keep them apart."""
    slot = (settings.port_base - PORT_RANGE[0]) // PORT_STEP
    first = slot * JOB_ID_BLOCK + 1
    return first, first + JOB_ID_BLOCK - 1


def slurm_conf(layout: Layout, settings: Settings, hostname: str, machine: Machine) -> str:
    """The text of slurm.conf; ``hostname`` is this machine's short name (slurmctld checks it)."""
    # cred_expire also holds a requeued job back that long before it may start again (default 120 s).
    auth = f"socket={layout.munge_socket},cred_expire={CRED_EXPIRE_S}"
    ctl = controller_address(settings)
    lines = [
        "# Generated by slurm/devcluster; edits are overwritten on the next `up`.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={hostname}({ctl})",
        f"SlurmctldPort={settings.port(CTLD)}",
        f"SlurmdPort={settings.port(SLURMD0)}",
        f"SlurmUser={user()}",
        f"SlurmdUser={user()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo={auth}",
        *communication(settings),
        f"StateSaveLocation={layout.ctld_state}",
        f"SlurmdSpoolDir={layout.spool_root}/%n",
        f"SlurmctldPidFile={layout.run}/slurmctld.pid",
        f"SlurmdPidFile={layout.run}/slurmd-%n.pid",
        f"SlurmctldLogFile={layout.log_file('slurmctld')}",
        f"SlurmdLogFile={layout.log}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"PlugStackConfig={layout.etc}/plugstack.conf",
        *binding(machine),
        "MpiDefault=none",
        "SwitchType=switch/none",
        "GresTypes=gpu",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=5,sched_interval=5",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        f"DefMemPerCPU={DEF_MEM_PER_CPU_MB}",
        f"FirstJobId={job_ids(settings)[0]}",
        f"MaxJobId={job_ids(settings)[1]}",
        "JobRequeue=1",
        "KillWait=5",
        "MinJobAge=30",
        "UnkillableStepTimeout=30",
        "InactiveLimit=0",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "MessageTimeout=10",
        "JobAcctGatherType=jobacct_gather/linux",
        "JobAcctGatherFrequency=30",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageTRES=gres/gpu",
        f"AccountingStorageHost={ctl}",
        f"AccountingStoragePort={settings.port(DBD)}",
        # For auth/munge, the socket clients and slurmctld use to authenticate to slurmdbd (not AuthInfo).
        f"AccountingStoragePass={layout.munge_socket}",
        "JobCompType=jobcomp/none",
        # The node's own /tmp (nodes as hosts); the state folder's when every node is this host.
        f"TmpFS={'/tmp' if settings.hosts else layout.root / 'tmp'}",
        *([] if machine.cgroups else [f"# cgroups not used: {machine.cgroup_problem}"]),
        *node_lines(settings, hostname, machine),
    ]
    return "\n".join(lines) + "\n"


def gres_conf(layout: Layout) -> str:
    """Each GPU node's GPUs as files of its own (gres.conf ``File=``; Slurm reads the index from the name)."""
    lines = ["# Generated by slurm/devcluster; edits are overwritten on the next `up`."]
    for node in NODE_SPECS:
        for path in layout.gpu_files(node.name, node.gpus):
            lines.append(f"NodeName={node.name} Name=gpu File={path}")
    return "\n".join(lines) + "\n"


def cgroup_conf() -> str:
    """cgroup v1: each job's cpuset is its CPUs, its memory limit what it asked for. Devices are not
    constrained: the GPU files are not device nodes. (Slurm 22.05 names the cgroups /slurm_<node>/uid_<uid>/
    job_<id>, not configurable: job_ids() keeps two clusters' jobs apart.)"""
    return "\n".join([
        "# Generated by slurm/devcluster; edits are overwritten on the next `up`.",
        "CgroupPlugin=cgroup/v1",
        "CgroupMountpoint=/sys/fs/cgroup",
        "ConstrainCores=yes",
        "ConstrainRAMSpace=yes",
        "AllowedRAMSpace=100",
        "ConstrainSwapSpace=no",
        "ConstrainDevices=no",
    ]) + "\n"


def slurmdbd_conf(layout: Layout, settings: Settings, hostname: str) -> str:
    """The text of slurmdbd.conf (must be mode 0600: it holds the database password)."""
    return "\n".join([
        "# Generated by slurm/devcluster; edits are overwritten on the next `up`.",
        "AuthType=auth/munge",
        f"AuthInfo=socket={layout.munge_socket}",
        f"DbdHost={hostname}",
        f"DbdAddr={controller_address(settings)}",
        f"DbdPort={settings.port(DBD)}",
        f"SlurmUser={user()}",
        "DebugLevel=info",
        f"LogFile={layout.log_file('slurmdbd')}",
        f"PidFile={layout.run}/slurmdbd.pid",
        "StorageType=accounting_storage/mysql",
        f"StorageHost={LOOPBACK}",
        f"StoragePort={settings.port(MYSQL)}",
        "StorageUser=slurm",
        f"StoragePass={settings.db_password}",
        "StorageLoc=slurm_acct_db",
    ]) + "\n"


def write_if_changed(path, text: str, mode: int = 0o644) -> bool:
    """Write ``text`` to ``path`` unless it already holds it; True when the file changed."""
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
    return True


def make_gpu_file(path: Path, index: int) -> bool:
    """A character device for gres.conf (Slurm refuses other files): NVIDIA's major number, the GPU's index
    as minor, so opening it fails as a GPU without a driver would. Where device nodes cannot be made (no
    CAP_MKNOD), a link named the same to /dev/null (Slurm stats through it; the index is in the name)."""
    if path.is_char_device():
        return False
    path.unlink(missing_ok=True)
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, index))
    except OSError:
        path.symlink_to("/dev/null")
    return True


def write_all(layout: Layout, settings: Settings, hostname: str, machine: Machine,
              plugins: str = "") -> bool:
    """Write every config file (and the GPU files); True when any changed (running daemons then need a
    restart)."""
    changed = False
    for node in NODE_SPECS:
        for index, path in enumerate(layout.gpu_files(node.name, node.gpus)):
            changed |= make_gpu_file(path, index)
    changed |= write_if_changed(layout.slurm_conf, slurm_conf(layout, settings, hostname, machine))
    changed |= write_if_changed(layout.etc / "gres.conf", gres_conf(layout))
    cgroup = layout.etc / "cgroup.conf"
    if machine.cgroups:
        changed |= write_if_changed(cgroup, cgroup_conf())
    elif cgroup.exists():
        cgroup.unlink()
        changed = True
    changed |= write_if_changed(layout.slurmdbd_conf, slurmdbd_conf(layout, settings, hostname), 0o600)
    # Only our SPANK plugins (pyxis.py's, where installed): the host's (/etc/slurm/plugstack.conf.d) stay out.
    changed |= write_if_changed(layout.etc / "plugstack.conf",
                                "# the devcluster's SPANK plugins (devcluster_lib/pyxis.py)\n" + plugins)
    return changed

"""A throwaway two-node SLURM cluster on one machine, for the multi-node tests (`make test-cluster`).

    with two_node_cluster(tmp_path) as cluster:   # cluster.env: os.environ + SLURM_CONF for clients
        subprocess.run(["sbatch", "--wait", "-N2", ...], env=cluster.env)

Each node is a network namespace joined to a bridge by a veth pair, with its own address, and each
of its daemons runs in its own UTS and mount namespace: `hostname` says the node's name and
/etc/hosts (bind-mounted from the work dir, visible only there) maps both nodes' names to their
addresses, as a cluster's DNS would. Node 1 runs munged and slurmctld; each node runs a slurmd with
its own `NodeName`, address and spool directory; one partition (`debug`) spans both. Job steps are
children of their node's slurmd, so the ranks of a job see their node's hostname, address and
interfaces. The bridge has an address in the machine's own namespace, from which the tests run the
client commands (sbatch, squeue, scancel, scontrol). The filesystem is the machine's on both nodes
(a cluster's shared filesystem): checkpoints, logs and the munge socket are reachable from both.

Names carry the test process's pid (netns `mmoe2n<pid>-<node>`, links `m2n<pid>br` / `m2n<pid>v<i>`),
so two clusters (and the one-node cluster of slurm_cluster.py, on 127.0.0.1) run side by side, and
a leftover of a killed test run (its pid gone) is found and removed when the next one starts.
Teardown, also after a failed test: cancel jobs, stop the daemons, SIGKILL whatever still runs in
the namespaces, delete them and the bridge, remove the spool, state and munge directories (the
daemons' logs stay in the work dir), undo the /run/netns mount `ip netns` makes if it was not there
before; then it checks that no namespace, link, mount or process is left and raises if one is.

`kill_node` is a power cut (SIGKILL every process of a node: slurmd, its job steps, the ranks);
`restart_node` starts the node's slurmd again and waits until it takes jobs. Needs root, iproute2
(`ip netns`), util-linux (`unshare`) and what slurm_cluster.py needs (`require_two_nodes()`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from tests.e2e.slurm_cluster import (CLIENTS, DAEMONS, SEARCH_PATH, _cancel_all, _common_conf, _start, _stop,
                                     _tail, _wait_for, _write_munge_key, require, unavailable_reason)

NETNS_PREFIX, LINK_PREFIX = "mmoe2n", "m2n"
_OWNED = re.compile(rf"^(?:{NETNS_PREFIX}(\d+)-\S+|{LINK_PREFIX}(\d+)(?:br|v\d+))$")
NODE_NAMES = ("mmoe-n1", "mmoe-n2")
NODELIST = "mmoe-n[1-2]"
PARTITION = "debug"  # slurm_cluster._cancel_all's partition
TOOLS = ("ip", "nsenter", "unshare", "mount")


@dataclass(frozen=True)
class Node:
    name: str  # NodeName and the hostname inside the node
    addr: str  # its address on the bridge
    netns: str
    veth: str  # the host end of its link to the bridge


def two_node_unavailable_reason() -> Optional[str]:
    """None if this machine can run the two-node cluster, else a one-line reason."""
    reason = unavailable_reason(DAEMONS + CLIENTS)
    if reason:
        return reason
    missing = [t for t in TOOLS if shutil.which(t, path=SEARCH_PATH) is None]
    if missing:
        return f"the two-node test cluster needs {', '.join(missing)} (iproute2, util-linux)"
    probe, had_netns_mount = f"{NETNS_PREFIX}{os.getpid()}-probe", _is_mountpoint("/run/netns")
    made = _run(["ip", "netns", "add", probe], check=False)
    _remove([probe], [])
    _undo_netns_mount(had_netns_mount)
    if made.returncode != 0:
        return f"network namespaces are not available here: ip netns add: {made.stderr.strip()}"
    return None


def require_two_nodes() -> None:
    """In a test: return if the two-node cluster can run, else skip saying why (fail under CI=true)."""
    require(two_node_unavailable_reason())


def _run(cmd: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PATH=SEARCH_PATH))
    if check and proc.returncode != 0:
        raise RuntimeError(f"test cluster: {' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def _netns_names() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> List[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", out, re.M)]


def _netns_pids(netns: str) -> List[int]:
    out = _run(["ip", "netns", "pids", netns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _mounts() -> List[str]:
    with open("/proc/mounts") as f:
        return f.read().splitlines()


def _is_mountpoint(path: str) -> bool:
    return any(line.split()[1] == path for line in _mounts())


def _undo_netns_mount(had_netns_mount: bool) -> None:
    """`ip netns add` bind-mounts /run/netns onto itself once; undo that if it was not there before
    and no namespace is left (a busy mount, another cluster's, stays)."""
    if not had_netns_mount and not _netns_names() and _is_mountpoint("/run/netns"):
        _run(["umount", "/run/netns"], check=False)


def _kill_all_in(netns: str, timeout: float = 20.0) -> List[int]:
    """SIGKILL every process in `netns` until none is left; return the pids still there (none if ok)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _netns_pids(netns)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _remove(netns_names: Sequence[str], links: Sequence[str], timeout: float = 20.0) -> None:
    """Kill the processes of, and delete, these namespaces and links; wait until they are gone
    (deleting a namespace removes its veth ends asynchronously)."""
    for ns in netns_names:
        _kill_all_in(ns)
        _run(["ip", "netns", "del", ns], check=False)
    for link in links:
        _run(["ip", "link", "del", link], check=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not set(netns_names) & set(_netns_names()) and not set(links) & set(_link_names()):
            return
        time.sleep(0.2)


def _owner_alive(pid: int) -> bool:
    return pid == os.getpid() or os.path.exists(f"/proc/{pid}")


def cleanup_leftovers() -> List[str]:
    """Remove the namespaces and links of two-node clusters whose test process is gone; return their names."""
    stale_ns, stale_links = [], []
    for names, stale in ((_netns_names(), stale_ns), (_link_names(), stale_links)):
        for name in names:
            m = _OWNED.match(name)
            if m and not _owner_alive(int(m.group(1) or m.group(2))):
                stale.append(name)
    if stale_ns or stale_links:
        _remove(stale_ns, stale_links)
    return stale_ns + stale_links


def _free_subnet() -> str:
    """'10.233.X' for a /24 that no address of this namespace uses (another cluster's bridge included)."""
    used = set(re.findall(r"inet 10\.233\.(\d+)\.", _run(["ip", "-o", "-4", "addr", "show"]).stdout))
    start = os.getpid() % 200
    for i in range(250):
        x = str((start + i) % 250 + 1)
        if x not in used:
            return f"10.233.{x}"
    raise RuntimeError("test cluster: no free 10.233.X.0/24 subnet")


def _two_node_conf(d: Path, nodes: Sequence[Node], cpus: int, munge_socket: Path, slurmd_timeout: int) -> str:
    node_lines = "".join(f"NodeName={n.name} NodeHostname={n.name} NodeAddr={n.addr} CPUs={cpus} State=UNKNOWN\n"
                         for n in nodes)
    return f"""\
ClusterName=megatron-moe-two-node
SlurmctldHost={nodes[0].name}({nodes[0].addr})
SlurmctldPort=6817
SlurmdPort=6818
{_common_conf(d, munge_socket, slurmd_timeout, cred_expire=10)}\
{node_lines}\
PartitionName={PARTITION} Nodes={NODELIST} Default=YES MaxTime=INFINITE State=UP
"""


class TwoNodeCluster:
    """The running cluster: `env` for client commands, `nodes`, and the node-level faults."""

    def __init__(self, workdir: Path, nodes: List[Node], env: Dict[str, str], conf: Path, hosts: Path,
                 timeout: float):
        self.workdir, self.nodes, self.env, self.conf, self.hosts = workdir, nodes, env, conf, hosts
        self.timeout = timeout
        self.procs: Dict[str, subprocess.Popen] = {}  # "munged", "slurmctld", "slurmd@<node>" (started order)
        self.killed: List[str] = []  # daemons of killed nodes (not expected to run)

    def node_command(self, node: Node, cmd: Sequence[str]) -> List[str]:
        """`cmd` inside `node`: its network namespace, and new UTS and mount namespaces with the
        node's hostname and the cluster's /etc/hosts. (nsenter, not `ip netns exec`, which would
        remount /sys without the cgroup filesystem slurmd needs.)"""
        return ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "--propagation", "private", "--",
                "sh", "-c", 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"', "node",
                node.name, str(self.hosts), *cmd]

    def run_on(self, node: Node, cmd: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.node_command(node, cmd), capture_output=True, text=True, timeout=timeout,
                              env=self.env)

    def logs(self) -> List[Path]:
        d = self.workdir
        return [d / "munged.log", d / "slurmctld.log"] + [d / f"slurmd-{n.name}.log" for n in self.nodes]

    def _start_in(self, label: str, node: Node, cmd: Sequence[str]) -> None:
        self.procs[label] = _start(self.node_command(node, cmd), self.env)
        if label in self.killed:
            self.killed.remove(label)

    def start_slurmd(self, node: Node) -> None:
        (self.workdir / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        self._start_in(f"slurmd@{node.name}", node, ["slurmd", "-D", "-N", node.name, "-f", str(self.conf)])

    def node_states(self) -> Dict[str, str]:
        """{node: state} from sinfo ('idle', 'allocated', 'down*', ...)."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True,
                             timeout=15)
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, names: Optional[Sequence[str]] = None, timeout: Optional[float] = None) -> None:
        names = list(names or (n.name for n in self.nodes))

        def idle() -> bool:
            dead = [label for label, p in self.procs.items() if p.poll() is not None and label not in self.killed]
            if dead:
                raise RuntimeError(f"test cluster: {', '.join(dead)} exited\n"
                                   + "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in self.logs()))
            states = self.node_states()
            return all(states.get(n) == "idle" for n in names)

        _wait_for(idle, timeout or self.timeout, f"nodes {', '.join(names)} idle", self.logs())

    def pids(self, node: Node) -> List[int]:
        return _netns_pids(node.netns)

    def kill_node(self, node: Node) -> None:
        """A power cut: SIGKILL every process of `node` (slurmd, slurmstepd, the ranks)."""
        self.killed += [label for label in self.procs if label.endswith("@" + node.name)
                        or (node is self.nodes[0] and label in ("munged", "slurmctld"))]
        left = _kill_all_in(node.netns)
        assert not left, f"processes of {node.name} survived SIGKILL: {left}"
        for label in self.killed:
            self.procs[label].wait(timeout=10)

    def restart_node(self, node: Node) -> None:
        """Start `node`'s slurmd again; return when both nodes take jobs (ReturnToService=2)."""
        self.start_slurmd(node)
        self.wait_idle()

    def link_bytes(self, node: Node) -> int:
        """Bytes through the node's link to the bridge so far, both directions (the veth's counters)."""
        out = _run(["ip", "-j", "-s", "link", "show", "dev", node.veth]).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


@contextmanager
def two_node_cluster(workdir: Path, cpus: int = 8, timeout: float = 90.0,
                     slurmd_timeout: int = 20) -> Iterator[TwoNodeCluster]:
    """Start the cluster with its files in `workdir`; yield it; tear it down (see the module docstring).
    `slurmd_timeout`: SlurmdTimeout, how long slurmctld waits before it marks a silent node DOWN."""
    cleanup_leftovers()
    d = Path(workdir).resolve()
    pid, subnet = os.getpid(), _free_subnet()
    nodes = [Node(name, f"{subnet}.{i}", f"{NETNS_PREFIX}{pid}-{name}", f"{LINK_PREFIX}{pid}v{i}")
             for i, name in enumerate(NODE_NAMES, 1)]
    bridge = f"{LINK_PREFIX}{pid}br"
    had_netns_mount = _is_mountpoint("/run/netns")
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    munge_socket = d / "munge" / "munge.socket"
    _write_munge_key(d / "munge" / "munge.key")
    hosts = d / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in nodes))
    conf = d / "slurm.conf"
    conf.write_text(_two_node_conf(d, nodes, cpus, munge_socket, slurmd_timeout))
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=SEARCH_PATH)
    cluster = TwoNodeCluster(d, nodes, env, conf, hosts, timeout)
    try:
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{subnet}.254/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        for n in nodes:
            _run(["ip", "netns", "add", n.netns])
            _run(["ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns])
            _run(["ip", "link", "set", n.veth, "master", bridge])
            _run(["ip", "link", "set", n.veth, "up"])
            for cmd in (["link", "set", "lo", "up"], ["link", "set", "eth0", "up"],
                        ["addr", "add", f"{n.addr}/24", "dev", "eth0"]):
                _run(["ip", "-n", n.netns, *cmd])
        cluster._start_in("munged", nodes[0], ["munged", "--foreground", "--force", f"--socket={munge_socket}",
                                     f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge/munged.pid",
                                     f"--log-file={d}/munged.log", f"--seed-file={d}/munge/munged.seed"])
        _wait_for(munge_socket.exists, timeout, "munged", cluster.logs())
        cluster._start_in("slurmctld", nodes[0], ["slurmctld", "-D", "-c", "-f", str(conf)])
        for n in nodes:
            cluster.start_slurmd(n)
        cluster.wait_idle()
        try:
            yield cluster
        finally:
            if cluster.procs["slurmctld"].poll() is None:
                _cancel_all(env)
    finally:
        _teardown(cluster, bridge, had_netns_mount)


def _teardown(cluster: TwoNodeCluster, bridge: str, had_netns_mount: bool) -> None:
    _stop(list(cluster.procs.values()))
    names = [n.netns for n in cluster.nodes]
    survivors = {ns: _kill_all_in(ns) for ns in names if ns in _netns_names()}
    _remove(names, [bridge] + [n.veth for n in cluster.nodes])  # and wait until the veths are gone too
    for sub in ("munge", "state", "spool"):
        shutil.rmtree(cluster.workdir / sub, ignore_errors=True)
    _undo_netns_mount(had_netns_mount)
    left = [f"netns {n}" for n in set(names) & set(_netns_names())]
    left += [f"link {link}" for link in _link_names() if _OWNED.match(link) and str(os.getpid()) in link]
    left += [f"mount {line.split()[1]}" for line in _mounts()
             if any(n in line for n in names) or str(cluster.workdir) in line]
    left += [f"process {label} ({p.pid})" for label, p in cluster.procs.items() if p.poll() is None]
    left += [f"processes {pids} in {ns}" for ns, pids in survivors.items() if pids]
    if not had_netns_mount and not _netns_names() and _is_mountpoint("/run/netns"):
        left.append("mount /run/netns")
    assert not left, "the two-node test cluster left behind: " + ", ".join(left)

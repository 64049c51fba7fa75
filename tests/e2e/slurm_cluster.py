"""A throwaway one-node SLURM cluster for tests: munged, slurmctld and slurmd as root in a temp dir.

    with slurm_cluster(tmp_path) as env:          # env: os.environ + SLURM_CONF for client commands
        subprocess.run(["sbatch", "--wait", ...], env=env)

The node advertises `cpus` CPUs whatever the machine has (`SlurmdParameters=config_overrides`), so
`sbatch -N1 -n4` runs 4 tasks on a 2-core machine. Nothing outside the temp dir is touched: munged
gets its own key and socket (`AuthInfo=socket=...`); the daemons listen on free ports of 127.0.0.1
and keep their state, spool, pid and log files there. Needs Debian's `slurm-wlm` and `munge` and root;
`unavailable_reason()` says why a machine cannot run it, and `require_slurm()` is how a test asks:
it skips with that reason, or fails under `CI=true` (.ci/run installs SLURM, so CI must not go green
without the SLURM tests).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")
SEARCH_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # the daemons live in /usr/sbin


def unavailable_reason(tools: Sequence[str] = DAEMONS + CLIENTS, need_root: bool = True) -> Optional[str]:
    """None if this machine has `tools` (and root, if `need_root`; default: what the cluster needs),
    else a one-line reason."""
    missing = [b for b in tools if shutil.which(b, path=SEARCH_PATH) is None]
    if missing:
        return (f"SLURM not installed (missing {', '.join(missing)}): as root run "
                f"'apt-get install -y slurm-wlm munge' (.ci/run does)")
    if need_root and os.geteuid() != 0:
        return "starting munged/slurmctld/slurmd for the test cluster needs root"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(reason: Optional[str]) -> None:
    """In a test: return if `reason` (why the machine cannot run it) is None, else skip the test
    saying why, or fail it under CI=true."""
    import pytest

    if reason is None:
        return
    if in_ci():
        pytest.fail(f"{reason} [CI=true: the SLURM tests must run]", pytrace=False)
    pytest.skip(reason)


def require_slurm(tools: Sequence[str] = DAEMONS + CLIENTS, need_root: bool = True) -> None:
    """In a test: return if SLURM is usable (`unavailable_reason`), else skip the test saying why,
    or fail it under CI=true."""
    require(unavailable_reason(tools, need_root))


def _die_with_parent() -> None:
    """Runs in the daemon's child process: SIGTERM it if the test process dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _start(cmd: List[str], env: Dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_munge_key(path: Path) -> None:
    path.write_bytes(os.urandom(1024))
    path.chmod(0o400)


def _common_conf(d: Path, munge_socket: Path, slurmd_timeout: int = 300, cred_expire: int = 120) -> str:
    """slurm.conf lines every test cluster shares: root daemons, munge on `munge_socket`, state,
    spool, pid and log files under `d` (the slurmd files per node, `%n`), no cgroups or accounting.
    `slurmd_timeout`: seconds before slurmctld marks a silent node DOWN; `cred_expire`: a job step
    credential's lifetime, also how long a requeued job waits before it may start again."""
    return f"""\
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (cred_expire + 1 s; Slurm's default 120 s)
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
# the main scheduling loop every 2 s (default 60 s): starts a requeued job soon after its delay
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
KillWait=10
# a small MinJobAge makes `sbatch --wait` poll every 2 s (else after 2, 8, 32, ... s)
MinJobAge=4
"""


def _slurm_conf(d: Path, node: str, cpus: int, munge_socket: Path) -> str:
    return f"""\
ClusterName=megatron-moe-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
{_common_conf(d, munge_socket, cred_expire=10)}\
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stop(procs: List[subprocess.Popen]) -> None:
    for p in reversed(procs):  # slurmd, slurmctld, munged
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_for(check, timeout: float, what: str, logs: List[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise RuntimeError(f"test SLURM cluster: {what} not ready after {timeout:.0f}s\n"
                       + "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in logs))


def _cancel_all(env: Dict[str, str], timeout: float = 30.0) -> None:
    """Cancel leftover jobs (a failed test) and wait until their steps are gone."""
    subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True, timeout=15)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=15)
        if out.returncode != 0 or not out.stdout.strip():
            return
        time.sleep(0.5)


@contextmanager
def slurm_cluster(workdir: Path, cpus: int = 8, timeout: float = 60.0) -> Iterator[Dict[str, str]]:
    """Start the cluster in `workdir`, yield the environment for client commands, tear it down."""
    d = Path(workdir).resolve()
    node = socket.gethostname().split(".")[0]
    for sub in ("munge", "state", f"spool/{node}"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    munge_socket = d / "munge" / "munge.socket"
    _write_munge_key(d / "munge" / "munge.key")
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, node, cpus, munge_socket))
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=SEARCH_PATH)
    logs = [d / "munge" / "munged.log", d / "slurmctld.log", d / f"slurmd-{node}.log"]
    procs: List[subprocess.Popen] = []
    try:
        procs.append(_start(["munged", "--foreground", "--force", f"--socket={munge_socket}",
                             f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge/munged.pid",
                             f"--log-file={logs[0]}", f"--seed-file={d}/munge/munged.seed"], env))
        _wait_for(munge_socket.exists, timeout, "munged", logs)
        procs.append(_start(["slurmctld", "-D", "-c", "-f", str(conf)], env))
        procs.append(_start(["slurmd", "-D", "-N", node, "-f", str(conf)], env))

        def node_idle() -> bool:
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"test SLURM cluster: {', '.join(dead)} exited\n"
                                   + "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in logs))
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True,
                                 timeout=15)
            return out.returncode == 0 and out.stdout.strip() == "idle"

        _wait_for(node_idle, timeout, f"node {node} idle", logs)
        try:
            yield env
        finally:
            _cancel_all(env)
    finally:
        _stop(procs)

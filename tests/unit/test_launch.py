"""launch.py: torchrun / SLURM environment parsing, SLURM host lists, backend and device choice."""
import os
import socket
import subprocess

import pytest

from megatron_moe.config import ConfigError, load_config
from megatron_moe.config.validate import validate_placement
from megatron_moe.distributed.launch import (LaunchInfo, Placement, detect_launch, expand_nodelist, gather_placement,
                                             local_device_index, pick_backend, placement_from_env, route_address,
                                             slurm_master, spans_nodes, tasks_per_node_from_env, world_size_from_env,
                                             gloo_address_problem)
from tests.e2e.slurm_cluster import require_slurm

# What `srun` sets for task 5 of a 2-node x 4-task step (copied from a real step's environment).
SRUN_ENV = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_JOB_NODELIST": "node[03-04]", "SLURM_STEP_NODELIST": "node[03-04]"}


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[03-05,7],gpu1", ["node03", "node04", "node05", "node7", "gpu1"]),
    ("a1,b2", ["a1", "b2"]),
    ("single", ["single"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[008-10]", ["n008", "n009", "n010"]),
    ("a[1-2],b[3],c", ["a1", "a2", "b3", "c"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[1,3]y[7,9]", ["x1y7", "x1y9", "x3y7", "x3y9"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_matches_scontrol(tmp_path):
    """Same expansion as Slurm's own `scontrol show hostnames` (needs only a minimal slurm.conf)."""
    require_slurm(("scontrol",), need_root=False)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    for nodelist in ["node[03-05,7],gpu1", "a1,b2", "n[008-10],m[9-11]", "rack[1-2]-n[01-02]",
                     "x[1-3,5-6]y[7,9]", "gpu-a100-[001-003]"]:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True,
                             text=True, timeout=10, check=True)
        assert expand_nodelist(nodelist) == out.stdout.split(), nodelist


@pytest.mark.parametrize("bad", ["node[3-1]", "node[a-b]", "node[1-2", "node1]", "a,,b", "node[]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        expand_nodelist(bad)


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
    assert detect_launch(env) == LaunchInfo(3, 4, 1, "10.1.2.3", 29400, "torchrun")


def test_torchrun_inside_slurm_allocation_wins():
    """One torchrun per node under srun: torchrun's RANK/WORLD_SIZE, not the node task's SLURM ids."""
    env = dict(SRUN_ENV, RANK="9", WORLD_SIZE="16", LOCAL_RANK="1", MASTER_ADDR="node03", MASTER_PORT="29500")
    info = detect_launch(env)
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("torchrun", 9, 16, 1)


def test_slurm_step_env_derives_master_from_job():
    info = detect_launch(SRUN_ENV)
    assert info == LaunchInfo(5, 8, 1, "node03", 10000 + 4242 % 20000, "slurm")
    assert world_size_from_env(SRUN_ENV) == 8


def test_slurm_master_prefers_exported_variables_and_step_nodelist():
    assert slurm_master(dict(SRUN_ENV, MASTER_ADDR="login1", MASTER_PORT="12345")) == ("login1", 12345)
    assert slurm_master(dict(SRUN_ENV, SLURM_STEP_NODELIST="node04", SLURM_JOB_ID="25000")) == ("node04", 15000)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        slurm_master({"SLURM_JOB_ID": "1"})
    with pytest.raises(ValueError, match="MASTER_PORT"):
        slurm_master({"SLURM_JOB_NODELIST": "n1"})


def test_slurm_batch_shell_is_a_single_process():
    """The batch script itself has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but no step:
    running the entry point there without srun is one process, not rank 0 of 4 waiting forever."""
    batch = {k: v for k, v in SRUN_ENV.items() if not k.startswith("SLURM_STEP")}
    batch.update(SLURM_PROCID="0", SLURM_LOCALID="0")
    assert detect_launch(batch).source == "single"
    assert detect_launch({}) == LaunchInfo(0, 1, 0, "127.0.0.1", 29500, "single")


def test_bad_launch_env_is_a_one_line_error():
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="rank 8 is outside world size 8"):
        detect_launch(dict(SRUN_ENV, SLURM_PROCID="8"))


def test_pick_backend():
    assert pick_backend("auto", cuda_available=False) == "gloo"
    assert pick_backend("auto", cuda_available=True) == "nccl"
    assert pick_backend("gloo", cuda_available=True) == "gloo"
    assert pick_backend("nccl", cuda_available=True) == "nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        pick_backend("nccl", cuda_available=False)
    with pytest.raises(ValueError, match="parallel.backend=mpi is not one of auto, gloo, nccl"):
        pick_backend("mpi", cuda_available=False)


def test_local_device_index():
    assert [local_device_index(r, 8) for r in range(8)] == list(range(8))  # --gpus-per-node: all visible
    assert local_device_index(5, 1) == 0  # --gpus-per-task=1: each task sees only its own GPU
    with pytest.raises(ValueError, match="local rank 4 has no GPU"):
        local_device_index(4, 4)


def test_tasks_per_node_from_slurm_lists():
    assert tasks_per_node_from_env({"SLURM_TASKS_PER_NODE": "2(x3),1"}) == [2, 2, 2, 1]
    assert tasks_per_node_from_env({"SLURM_TASKS_PER_NODE": "4", "SLURM_STEP_TASKS_PER_NODE": "3,1"}) == [3, 1]
    assert tasks_per_node_from_env({"SLURM_TASKS_PER_NODE": "2(3)"}) is None
    assert tasks_per_node_from_env({}) is None


def test_placement_from_slurm_env_is_block_order():
    env = dict(SRUN_ENV, SLURM_TASKS_PER_NODE="4(x2)")
    assert placement_from_env(env, 8).hosts == ("node03",) * 4 + ("node04",) * 4
    assert placement_from_env(env, 8).block_size() == 4
    assert placement_from_env(dict(env, SLURM_STEP_TASKS_PER_NODE="5,3"), 8).block_size() is None
    assert placement_from_env(env, 6) is None  # not this job's task count
    assert placement_from_env(dict(env, SLURM_DISTRIBUTION="cyclic"), 8) is None  # unknown before the ranks run
    assert placement_from_env({"RANK": "0", "WORLD_SIZE": "8"}, 8) is None


def test_placement_describes_nodes_and_ranks():
    p = Placement(("a", "a", "b", "b"), ("10.0.0.1 (eth0)",) * 2 + ("10.0.0.2 (eth0)",) * 2)
    assert p.nodes() == [("a", [0, 1]), ("b", [2, 3])] and p.block_size() == 2
    assert p.describe() == "2 nodes: a 10.0.0.1 (eth0) ranks 0-1; b 10.0.0.2 (eth0) ranks 2-3"
    cyclic = Placement(("a", "b", "a", "b", "a"))
    assert cyclic.block_size() is None and cyclic.describe() == "2 nodes: a ranks 0,2,4; b ranks 1,3"
    assert Placement(("a", "a", "a", "b")).describe() == "2 nodes: a ranks 0-2; b rank 3"


def _cfg(ranks_per_node=None):
    cfg = load_config("configs/gpt_moe_tiny.yaml")
    cfg.parallel.ranks_per_node = ranks_per_node
    return cfg


def test_ranks_per_node_follows_the_real_placement():
    two_nodes = Placement(("a", "a", "b", "b"))
    assert validate_placement(_cfg(), two_nodes) == 2  # null: from where the ranks run
    assert validate_placement(_cfg(2), two_nodes) == 2
    assert validate_placement(_cfg(), Placement(("a",) * 4)) is None  # one node
    assert validate_placement(_cfg(2), Placement(("a",) * 4)) == 2  # one machine: simulated nodes
    assert validate_placement(_cfg(2), None) == 2
    with pytest.raises(ConfigError, match=r"^parallel.ranks_per_node=4 contradicts where the ranks run \(2 nodes: a "
                                          r"ranks 0-1; b ranks 2-3\): set it to 2 or leave it null"):
        validate_placement(_cfg(4), two_nodes)
    with pytest.raises(ConfigError, match=r"^parallel.ranks_per_node: the ranks are not placed in equal blocks of "
                                          r"consecutive ranks per node \(2 nodes: a ranks 0,2; b ranks 1,3\)"):
        validate_placement(_cfg(), Placement(("a", "b", "a", "b")))
    with pytest.raises(ConfigError, match="not placed in equal blocks"):
        validate_placement(_cfg(), Placement(("a", "a", "a", "b")))


def test_single_process_placement_is_this_host():
    info = detect_launch({})
    placement = gather_placement(info)
    assert placement.nodes() == [(socket.gethostname(), [0])]
    assert route_address("127.0.0.1", 29500) == "127.0.0.1 (lo)"
    assert route_address("no-such-host.invalid", 1) == ""


def test_spans_nodes():
    assert spans_nodes({"SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NUM_NODES": "2"})
    assert not spans_nodes({"SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "2"})  # this step: one node
    assert not spans_nodes({})
    assert not spans_nodes({"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})  # maybe one machine
    assert not spans_nodes({"RANK": "0", "WORLD_SIZE": "8", "SLURM_JOB_NUM_NODES": "2"})  # torchrun wins


def test_gloo_on_a_loopback_address_is_refused_naming_the_fix():
    def resolver(table):
        def resolve(name):
            if name not in table:
                raise socket.gaierror(-2, "Name or service not known")
            return table[name]
        return resolve

    assert gloo_address_problem({}, "n1", resolver({"n1": "10.0.0.1"})) is None
    assert gloo_address_problem({"GLOO_SOCKET_IFNAME": "eth0"}, "n1", resolver({"n1": "127.0.1.1"})) is None
    assert gloo_address_problem({}, "n1", resolver({"n1": "127.0.1.1"})) == (
        "gloo would listen on a loopback address on n1 (its name resolves to 127.0.1.1), which the other nodes cannot "
        "reach: set GLOO_SOCKET_IFNAME to the interface toward the other nodes, or map n1 to that interface's address "
        "(DNS, /etc/hosts)")
    assert "(its name does not resolve)" in gloo_address_problem({}, "n1", resolver({}))

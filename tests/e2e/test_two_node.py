"""Multi-node for real: the sbatch scripts as shipped on a two-node SLURM cluster on this machine
(tests/e2e/two_node_cluster.py: two network namespaces on a bridge, each with its own hostname,
address and slurmd; docs/running.md "Multi-node").

Smoke (run by `make test` and CI too): `sbatch -N2 --ntasks-per-node=2` trains across both nodes
(the master from the node list, the ranks' hostnames and addresses, `parallel.ranks_per_node`
from SLURM); a node that dies mid-step ends the job within 90 s, named, with no rank left.
The full set (`cluster` marker; `make test-cluster` runs the whole module) adds: losses equal to
the same job on one node; a `parallel.ranks_per_node` that contradicts the placement is one line;
the inter-node byte counters of the topology gate and of hierarchical EPLB equal the simulator's
analytic count on the run's own routing trace, and crossed the bridge; with the node-deduplicated
dispatch they equal the count from the routing trace and fall, as the bridge's bytes do, with
`moe.router_group_topk`; `scancel --signal=USR1`
saves on both nodes, requeues and resumes exactly; that checkpoint loads on one node in another
layout; pipeline 2 with a stage per node trains exactly.
"""
import json
import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.two_node_cluster import two_node_cluster, require_two_nodes

pytestmark = pytest.mark.e2e
cluster_only = pytest.mark.cluster  # the full set: `make test-cluster`, not `make test`

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/slurm/pretrain_gpt_moe.sbatch"
ITERS = 16
RUN = ["--config", "configs/gpt_moe_tiny.yaml", f"training.train_iters={ITERS}", "training.log_interval=1",
       "model.seq_length=32"]
TWO_NODES = ["-N2", "--ntasks-per-node=2"]
EP4 = ["parallel.expert=4"]  # the expert-parallel group spans both nodes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_two_nodes()
    with two_node_cluster(tmp_path_factory.mktemp("two_node")) as c:
        yield c


class Job:
    """`sbatch --wait` of the shipped script in the background, submitted from the repository root;
    its log is `<log_dir>/<name>-<job id>.log`."""

    def __init__(self, cluster, log_dir: Path, name: str, args):
        self.cluster, self.log_dir, self.name = cluster, log_dir, name
        self.proc = subprocess.Popen(["sbatch", "--wait", f"--job-name={name}", f"--output={log_dir}/%x-%j.log",
                                      *args], cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def job_id(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-n", self.name, "-o", "%i"], env=self.cluster.env,
                                 capture_output=True, text=True, timeout=15).stdout.split()
            if out:
                return out[0]
            time.sleep(0.2)
        raise AssertionError(f"job {self.name} not in the queue")

    def wait(self, timeout: float = 300):
        """(sbatch's exit code = the job's, the job's log)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            subprocess.run(["scancel", "-n", self.name], env=self.cluster.env, timeout=15)
            raise AssertionError(f"job {self.name} still running after {timeout:.0f} s:\n{self.log()[-3000:]}")
        submitted = re.search(r"Submitted batch job (\d+)", out)
        assert submitted, out
        self.id = submitted.group(1)
        return self.proc.returncode, self.log()

    def state(self) -> str:
        """The ended job's JobState (slurmctld keeps it MinJobAge = 300 s), e.g. NODE_FAIL."""
        out = subprocess.run(["scontrol", "-o", "show", "job", self.id], env=self.cluster.env, capture_output=True,
                             text=True, timeout=15).stdout
        found = re.search(r"\bJobState=(\S+)", out)
        return found.group(1) if found else f"(unknown: {out.strip() or 'no record'})"

    def log(self) -> str:
        logs = list(self.log_dir.glob(f"{self.name}-*.log"))
        return logs[0].read_text() if logs else "(no log)"


def run_job(cluster, log_dir: Path, name: str, args, timeout: float = 300):
    return Job(cluster, log_dir, name, args).wait(timeout)


def records(run_dir: Path):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def wait_for_iterations(job: Job, run_dir: Path, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert job.proc.poll() is None, f"the job ended early:\n{job.log()[-3000:]}"
        if (run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {count} iterations within {timeout} s:\n{job.log()[-3000:]}")


def same_losses(got, reference, first: int = 1) -> None:
    """Iterations first..ITERS of `got` (records) equal the reference's (rel 1e-5)."""
    ref = {r["iteration"]: r for r in reference}
    assert [r["iteration"] for r in got] == list(range(first, ITERS + 1))
    for r in got:
        for key in ("loss", "aux_loss", "grad_norm"):
            assert r[key] == pytest.approx(ref[r["iteration"]][key], rel=1e-5), (r["iteration"], key)


def placement_line(cluster) -> str:
    a, b = cluster.nodes
    return f"placement: 2 nodes: {a.name} {a.addr} (eth0) ranks 0-1; {b.name} {b.addr} (eth0) ranks 2-3"


def rank_processes(cluster):
    """[(node, pid, command line)] of the training ranks still running on either node."""
    out = []
    for node in cluster.nodes:
        for pid in cluster.pids(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "pretrain_gpt_moe.py" in cmdline:
                out.append((node.name, pid, cmdline))
    return out


# ---- smoke: `make test` and CI ------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_node_run(cluster, tmp_path_factory):
    d = tmp_path_factory.mktemp("two_node_run")
    code, log = run_job(cluster, d, "two-node", TWO_NODES + [SCRIPT] + RUN + EP4 + [f"training.run_dir={d}/run"])
    return code, log, d / "run"


def test_sbatch_trains_across_two_nodes(cluster, two_node_run):
    """Master from the node list (as `scontrol show hostnames` expands it), the ranks' real hosts
    and addresses in the log, parallel.ranks_per_node = 2 from SLURM (the all-to-all crosses nodes)."""
    code, log, run_dir = two_node_run
    assert code == 0, log
    header = re.search(r"job \d+ \(two-node\): 4 tasks on (\S+), master (\S+):\d+", log)
    assert header, log
    hosts = subprocess.run(["scontrol", "show", "hostnames", header.group(1)], env=cluster.env, capture_output=True,
                           text=True, timeout=15, check=True).stdout.split()
    assert hosts == [n.name for n in cluster.nodes] and header.group(2) == hosts[0]
    assert f"0: {placement_line(cluster)}\n" in log, log
    logged = records(run_dir)
    assert [r["iteration"] for r in logged] == list(range(1, ITERS + 1))
    assert all(math.isfinite(r["loss"]) and 0 < r["loss"] < 20 for r in logged)
    for r in logged:  # rank 0 sends part of its tokens to the experts of ranks 2-3 on the other node
        assert 0 < r["comm_bytes_inter_node"]["all_to_all"] < r["comm_bytes"]["all_to_all"], r


def test_killed_node_ends_the_job_within_90s_naming_it(cluster, tmp_path):
    """A power cut of node 2 (SIGKILL to its slurmd, slurmstepd and ranks) mid-step: the job ends
    within 90 s (slurmctld marks the node DOWN after SlurmdTimeout=20 s), its log names the node,
    and no rank is left on either node. The node then comes back for the next tests."""
    dead = cluster.nodes[1]
    job = Job(cluster, tmp_path, "kill-node", ["--no-requeue"] + TWO_NODES + [SCRIPT] + RUN + EP4 + [
        "training.train_iters=100000", f"training.run_dir={tmp_path}/run"])
    killed = None
    try:
        wait_for_iterations(job, tmp_path / "run", 2)
        cluster.kill_node(dead)
        killed = time.monotonic()
        code, log = job.wait(timeout=150)
        took = time.monotonic() - killed
        left = rank_processes(cluster)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
        if killed is not None:
            cluster.restart_node(dead)
    # srun returns first (the script exits 1: FAILED), or slurmctld ends the job first (NODE_FAIL:
    # the batch script is killed before it exits, and `sbatch --wait` may then exit 0)
    state = job.state()
    assert code != 0 or state == "NODE_FAIL", f"exit code {code}, state {state}\n{log}"
    assert took < 90, f"the job took {took:.0f} s to end after node {dead.name} died:\n{log[-3000:]}"
    assert re.search(rf"srun: error: Node failure on {dead.name}", log), log[-3000:]
    assert not left, left


# ---- the full set: `make test-cluster` ----------------------------------------------------------

@pytest.fixture(scope="module")
def one_node_run(cluster, tmp_path_factory):
    d = tmp_path_factory.mktemp("one_node_run")
    code, log = run_job(cluster, d, "one-node", ["-N1", "-n4", SCRIPT] + RUN + EP4 + [f"training.run_dir={d}/run"])
    assert code == 0, log
    return log, records(d / "run")


@cluster_only
def test_two_node_losses_equal_one_node(two_node_run, one_node_run):
    code, log, run_dir = two_node_run
    assert code == 0, log
    one_log, reference = one_node_run
    same_losses(records(run_dir), reference)
    assert "placement:" not in one_log  # one node: 4 ranks per node, nothing crosses a node
    assert all(not r["comm_bytes_inter_node"] for r in reference), reference[0]["comm_bytes_inter_node"]


@cluster_only
def test_ranks_per_node_that_contradicts_the_placement_is_one_line(cluster, tmp_path):
    """Checked against the job's node list before srun starts any rank (the ranks check it again
    on their real hosts: tests/unit/test_launch.py)."""
    code, log = run_job(cluster, tmp_path, "rpn-config", TWO_NODES + [SCRIPT] + RUN + ["parallel.ranks_per_node=4"])
    errors = [line for line in log.splitlines() if "error" in line]
    a, b = cluster.nodes
    assert code == 2 and errors == [
        f"config error: parallel.ranks_per_node=4 contradicts where the ranks run (2 nodes: {a.name} ranks 0-1; "
        f"{b.name} ranks 2-3): set it to 2 or leave it null to take it from the launcher"], log
    assert not re.search(r"^\d+: ", log, re.M), "ranks were started"


# Topology-aware routing across the bridge: EP spans 2 nodes x 2 ranks (8 experts, 2 per rank)
TOPOLOGY_CASES = {
    "topology-gate": ["moe.gate=topology"],
    "hierarchical-eplb": ["moe.balancer=eplb", "moe.eplb.interval=1", "moe.eplb.hierarchical=true"],
    # DeepSeek-V3's node-limited routing: 2 groups of 4 experts (one per node), each token's experts
    # in 1 group; EPLB's `auto` goes hierarchical with it
    "group-limited-routing": ["moe.router_groups=2", "moe.router_group_topk=1", "moe.balancer=eplb",
                              "moe.eplb.interval=1"],
}


@cluster_only
@pytest.mark.parametrize("case", list(TOPOLOGY_CASES))
def test_inter_node_bytes_equal_the_analytic_count(cluster, tmp_path, case):
    """Rank 0's `comm_bytes_inter_node`, every iteration and op kind (all-to-all, EPLB's moves),
    equals the simulator's count replayed from the run's routing trace on the real placement
    (2 ranks per node; tests/distributed/test_sim_bytes.py proves the simulator on simulated
    nodes); the bridge carried at least every rank's counted inter-node bytes."""
    from megatron_moe.config import load_config
    from megatron_moe.perf.hardware import load_profile
    from megatron_moe.sim.runner import Simulation

    run_dir = tmp_path / "run"
    before = cluster.link_bytes(cluster.nodes[1])
    code, log = run_job(cluster, tmp_path, case, TWO_NODES + [SCRIPT] + RUN + EP4 + TOPOLOGY_CASES[case] + [
        "training.train_iters=3", "logging.routing_trace=true", f"training.run_dir={run_dir}"])
    assert code == 0, log
    crossed = cluster.link_bytes(cluster.nodes[1]) - before
    logged = records(run_dir)
    cfg = load_config(str(run_dir / "config.yaml"), ["parallel.ranks_per_node=2"])  # the placement the run found
    total, kinds = 0, set()
    with tempfile.TemporaryDirectory() as work:
        sim = Simulation(cfg, load_profile("configs/hardware/cpu_gloo_2proc.yaml"), 4, work)
        steps = list(sim.trace(str(run_dir / "routing"), 0).steps())
        assert [it for it, _, _ in steps] == [r["iteration"] for r in logged] == [1, 2, 3]
        for (iteration, counts, micro), record in zip(steps, logged):
            sim.iteration(iteration, counts, micro)
            inter = sim.traffic[1]  # {"<kind>/<group>": bytes [rank]} sent to another node
            expected = {}
            for key, per_rank in inter.items():
                if round(per_rank[0]):
                    expected[key.split("/")[0]] = expected.get(key.split("/")[0], 0) + int(round(per_rank[0]))
            assert record["comm_bytes_inter_node"] == expected, (iteration, record["comm_bytes_inter_node"], expected)
            total += int(round(sum(v.sum() for v in inter.values())))
            kinds |= set(expected)
    assert "all_to_all" in kinds and ("moe.balancer=eplb" not in TOPOLOGY_CASES[case] or "vexpert_move" in kinds), kinds
    assert crossed >= total > 0, (crossed, total)


# DeepSeek-V3's node-limited routing paying off: the node-deduplicated dispatch (docs/node_dedup.md)
# with 2 router groups of 4 experts, a group = one node's experts (owner-only placement, 2 per rank)
NODE_DEDUP = ["moe.router_groups=2", "moe.token_dispatch=node_dedup", "training.train_iters=3",
              "logging.routing_trace=true"]


def node_dedup_inter_node_bytes(micro_counts, hidden: int, top_k: int) -> dict:
    """Rank 0's inter-node bytes of one iteration of the node-deduplicated dispatch, expert 4 on
    2 nodes x 2 ranks with every token's experts on one node (router_group_topk=1, dropless): from
    the routing trace's counts [L, S, M, E] (source s = rank s, expert e on node e // 4). Per layer
    and micro-batch, forward: rank 0's tokens for node 1 (hop 1, one row each) and, as node 0's
    proxy of rank 2 (same local index), rank 2's tokens for node 0 (hop 1 back), with their
    routing (codes int64 + weights fp32 per choice; back: the weights' gradients) and the rows
    per proxy (int64 to ranks 2 and 3); backward: the token rows again."""
    to_node = micro_counts.reshape(micro_counts.shape[:3] + (2, -1)).sum(-1) // top_k  # [L, S, M, node]
    hop1, back = int(to_node[:, 0, :, 1].sum()), int(to_node[:, 2, :, 0].sum())
    calls = micro_counts.shape[0] * micro_counts.shape[2]
    return {"all_to_all": 2 * (hop1 + back) * hidden * 4,
            "all_to_all_routing": top_k * (8 + 4) * hop1 + top_k * 4 * back, "all_to_all_counts": calls * 8 * 2}


@cluster_only
def test_node_dedup_inter_node_bytes_fall_with_router_group_topk(cluster, tmp_path):
    """`moe.token_dispatch=node_dedup` across the bridge: with router_group_topk=1 rank 0's
    `comm_bytes_inter_node` equals, every iteration and kind, the count from the run's routing
    trace (`node_dedup_inter_node_bytes`); the counted all-to-all bytes and the bytes that crossed
    the bridge fall from router_group_topk=2 (a token's experts may sit on both nodes) to 1."""
    from megatron_moe.moe.routing_trace import load_routing_trace

    crossed, counted = {}, {}
    for topk in (2, 1):
        run_dir = tmp_path / f"topk{topk}"
        before = cluster.link_bytes(cluster.nodes[1])
        code, log = run_job(cluster, tmp_path, f"node-dedup-{topk}", TWO_NODES + [SCRIPT] + RUN + EP4 + NODE_DEDUP + [
            f"moe.router_group_topk={topk}", f"training.run_dir={run_dir}"])
        assert code == 0, log
        crossed[topk] = cluster.link_bytes(cluster.nodes[1]) - before
        logged = records(run_dir)
        counted[topk] = [r["comm_bytes_inter_node"]["all_to_all"] for r in logged]
    trace = load_routing_trace(str(tmp_path / "topk1" / "routing"))
    assert [int(i) for i in trace.iterations] == [r["iteration"] for r in logged] == [1, 2, 3]
    for micro, record in zip(trace.micro_counts, logged):
        assert record["comm_bytes_inter_node"] == node_dedup_inter_node_bytes(micro, 64, 2), record
    print(f"node_dedup: rank 0's inter-node all-to-all bytes per iteration {counted}, bridge bytes {crossed}")
    assert all(one < two for one, two in zip(counted[1], counted[2])), counted
    assert crossed[1] < crossed[2], crossed


@pytest.fixture(scope="module")
def requeued_run(cluster, tmp_path_factory):
    """A two-node job with `checkpoint.load=auto`, `scancel --signal=USR1` after iteration 2 (the
    time-limit warning's path), requeued by the job script, resumed to the end."""
    d = tmp_path_factory.mktemp("requeue")
    run_dir = d / "run"
    job = Job(cluster, d, "usr1", TWO_NODES + [SCRIPT] + RUN + EP4 + [
        f"training.run_dir={run_dir}", f"checkpoint.dir={d}/ckpt", "checkpoint.load=auto"])
    wait_for_iterations(job, run_dir, 2)
    subprocess.run(["scancel", "--signal=USR1", job.job_id()], env=cluster.env, check=True, timeout=15)
    code, log = job.wait(timeout=400)
    return code, log, run_dir


@cluster_only
def test_usr1_saves_on_both_nodes_requeues_and_resumes_exactly(requeued_run, one_node_run):
    code, log, run_dir = requeued_run
    assert code == 0, log
    stop = re.search(r"^0: SIGUSR1: stopped after iteration (\d+); checkpoint saved to (\S+); the job script "
                     r"requeues the job, which resumes from it \(checkpoint.load=auto\)$", log, re.M)
    assert stop, log
    stopped, ckpt = int(stop.group(1)), stop.group(2)
    assert 2 <= stopped < ITERS, log
    ranks = sorted(int(m.group(1)) for f in Path(ckpt).iterdir() if (m := re.fullmatch(r"__(\d+)_0\.distcp", f.name)))
    assert ranks == [0, 1, 2, 3], ranks  # every rank of both nodes wrote its experts
    assert re.search(rf"requeueing job \d+ \(restart 0\) to resume from {re.escape(ckpt)}$", log, re.M), log
    assert f"0: checkpoint: resumed from {ckpt} (iteration {stopped})" in log, log
    assert len(re.findall(r"finished with exit code 0$", log, re.M)) == 2, log  # both runs, one log
    same_losses(records(run_dir), one_node_run[1])  # 1..stopped, then stopped+1..ITERS after the requeue


@cluster_only
def test_two_node_checkpoint_loads_on_one_node_in_another_layout(cluster, tmp_path, requeued_run, one_node_run):
    """Saved on 2 nodes x 2 ranks (expert 4, data parallel 4), resumed by one process on one node:
    the continuation equals the uninterrupted one-node run."""
    log = requeued_run[1]
    stop = re.search(r"stopped after iteration (\d+); checkpoint saved to (\S+);", log)
    stopped, ckpt = int(stop.group(1)), stop.group(2)
    code, log = run_job(cluster, tmp_path, "relayout", ["-N1", "-n1", SCRIPT] + RUN + [
        f"checkpoint.load={ckpt}", f"training.run_dir={tmp_path}/run"])
    assert code == 0, log
    assert f"0: checkpoint: resumed from {ckpt} (iteration {stopped})" in log, log
    same_losses(records(tmp_path / "run"), one_node_run[1], first=stopped + 1)


@cluster_only
def test_pipeline_one_stage_per_node_trains_exactly(cluster, tmp_path, one_node_run):
    """Pipeline 2 on 2 nodes: stage 0 = node 1, stage 1 = node 2; the activations and gradients
    between the stages are all inter-node; the losses equal the one-node run without stages."""
    code, log = run_job(cluster, tmp_path, "pipeline", TWO_NODES + [SCRIPT] + RUN + [
        "parallel.pipeline=2", "parallel.expert=2", f"training.run_dir={tmp_path}/run"])
    assert code == 0, log
    assert f"0: {placement_line(cluster)}\n" in log and "0: rank 0/4: pp 0/2" in log, log
    logged = records(tmp_path / "run")
    same_losses(logged, one_node_run[1])
    for r in logged:
        assert r["comm_bytes_inter_node"]["pipeline"] == r["comm_bytes"]["pipeline"] > 0, r

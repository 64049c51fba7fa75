"""Host syncs of the MoE layer (issue #44 item 3) and capacity_keep's memory (item 7).

* A baseline MoE layer forward on one process reads device data on the host once: the helper
  (`perf/host_sync.py`) counts 1, and an independent count (`tests/host_reads.py`: every
  `.item()`, `.tolist()`, `.cpu()`, `int()`, `bool()`, `nonzero`, `bincount`, boolean mask, ...
  of data computed from the parameters or the input) sees that one read and nothing else.
  Every schedule and balancer on 4 processes: tests/distributed/test_host_syncs.py.
* The iteration's statistics stay on the device and are read in one go (`IterationMoEStats.on_host`).
* No bare host read in moe/, techniques/ or model/ outside an explicit allow-list, each entry
  with the reason it is not in the per-layer hot path.
* capacity_keep's sort-based positions equal the one-hot formula's, and no tensor it makes grows
  with the number of experts per token.
* On a GPU (`make test-gpu`): a layer forward under `torch.cuda.set_sync_debug_mode("error")`.
"""
import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.router import capacity_keep
from megatron_moe.moe.stats import IterationMoEStats
from megatron_moe.perf.host_sync import HOST_SYNCS, to_device, to_host, to_host_all
from tests.host_reads import HostReads

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_moe"
LAYERS = [  # (capacity_factor, top_k, activation, moe.* keys)
    (None, 2, "gelu", {}),
    (1.0, 1, "swiglu", {}),
    (1.0, 2, "swiglu", dict(score_function="sigmoid", expert_bias=True, router_groups=2, router_group_topk=1,
                            shared_expert_ffn_hidden_size=8)),
]


def _layer(capacity_factor, top_k, activation, keys, device="cpu"):
    cfg = Config()
    cfg.model.hidden_size, cfg.model.activation = 8, activation
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor = 4, top_k, capacity_factor
    cfg.moe.expert_ffn_hidden_size = 8
    for key, value in keys.items():
        setattr(cfg.moe, key, value)
    torch.manual_seed(0)
    return MoELayer(cfg, ParallelState.single_process(), layer_index=0).to(device)


def _counted_forward(layer, x):
    with HOST_SYNCS.counting() as helper, HostReads(list(layer.parameters()) + [x]) as independent:
        y, aux = layer(x)
    return y, aux, helper, independent


@pytest.mark.parametrize("grad", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", range(len(LAYERS)))
def test_baseline_forward_reads_the_host_once(case, grad):
    layer = _layer(*LAYERS[case])
    x = torch.randn(2, 6, 8, requires_grad=True)
    layer(x)  # warm-up: the grouped GEMM's one-time kernel probe
    with torch.set_grad_enabled(grad):
        y, aux, helper, independent = _counted_forward(layer, x)
    assert helper.reads == 1 and dict(helper.by_label) == {"counts": 1}
    assert independent.reads == 0, f"host reads outside the helper: {dict(independent.sites)}"
    assert independent.helper == 1  # the independent count sees exactly the helper's read
    assert independent.uploads == 0, f"host-to-device copies outside the helper: {dict(independent.sites)}"
    if grad:
        ((y * y.detach()).sum() + aux).backward()


def test_iteration_statistics_are_read_once_per_iteration():
    """Three layers, two micro-batches: `of` and `+` keep the counts where they are, `on_host`
    reads all of them in one helper call, with the values the per-layer stats hold."""
    layers = [_layer(*LAYERS[i]) for i in range(3)]
    per_micro_batch = []
    for _ in range(2):
        x = torch.randn(2, 6, 8)
        stats = []
        for layer in layers:
            layer(x)
            stats.append(layer.last_stats)
        per_micro_batch.append(stats)
    with HOST_SYNCS.counting() as helper, HostReads([s.tokens_per_expert for st in per_micro_batch for s in st]
                                                    + [s.dropped for st in per_micro_batch for s in st]) as seen:
        summed = IterationMoEStats.of(per_micro_batch[0]) + IterationMoEStats.of(per_micro_batch[1])
        assert helper.reads == 0 and seen.reads == 0, dict(seen.sites)
        host = summed.on_host()
    assert helper.reads == 1 and seen.reads == 0 and seen.helper == 1
    expected = torch.stack([a.tokens_per_expert + b.tokens_per_expert for a, b in zip(*per_micro_batch)])
    assert torch.equal(host.tokens_per_expert, expected)
    assert host.dropped.tolist() == [int(a.dropped + b.dropped) for a, b in zip(*per_micro_batch)]
    assert host.forward_counts.shape == (2, 3, 4) and torch.equal(host.forward_counts.sum(0), expected)


def test_helper_copies_and_counts():
    t, u = torch.arange(6).view(2, 3), torch.tensor([7, 8])
    with HOST_SYNCS.counting() as window:
        a, b = to_host_all([t, u], "both")
        c = to_host(t)
        sent = to_device([t, u.int()], torch.device("cpu"))
    assert window.reads == 2 and window.uploads == 1 and window.by_label == {"both": 1, "": 1}
    assert torch.equal(a, t) and torch.equal(b, u) and torch.equal(c, t) and a.data_ptr() != t.data_ptr()
    assert [s.dtype for s in sent] == [torch.long, torch.int32] and torch.equal(sent[0], t)
    with pytest.raises(ValueError, match="one dtype per read"):
        to_host_all([t, t.float()])


# -- no bare host reads ----------------------------------------------------------------------------
HOST_READS = {"item", "tolist", "cpu", "numpy", "nonzero", "bincount", "unique", "argwhere", "masked_select"}
# modules that plan on numpy arrays of the counts the forward read once (or of slot tables)
HOST_MODULES = {
    "moe/vexperts.py": "vExpert slot tables and their routing: numpy on the host",
    "techniques/flexmoe/flexmoe_plan.py": "FlexMoE's planner: numpy on the host counts",
    "techniques/flexmoe/flexmoe_policy.py": "FlexMoE's policy: numpy on the host loads, between iterations",
    "techniques/eplb/eplb_plan.py": "EPLB's plan: numpy on the host loads, between iterations",
    "techniques/proprophet/proprophet.py": "Pro-Prophet's planner: numpy on the host counts",
}
ALLOWED = {  # (module, function): why it reads no device data in a layer's forward
    ("moe/placement.py", "Placement.send_splits"): "host routing table",
    ("moe/placement.py", "Placement.recv_splits"): "host routing table",
    ("moe/placement.py", "Placement.expert_counts"): "host routing table",
    ("moe/placement.py", "Placement.expert_counts_from"): "host routing table",
    ("techniques/fastermoe/fastermoe.py", "select_shadow_experts"): "FasterMoE's Alg. 1 on the host counts",
    ("techniques/fastermoe/fastermoe.py", "fastmoe_release_shadow"): "FastMoE's policy on the host counts",
    ("techniques/flexmoe/vexpert_base.py", "SlotBalancer.plan"): "flexible routing on the host counts",
    ("techniques/flexmoe/vexpert_base.py", "SlotBalancer.observe"): "the load window, numpy, from the host counts",
    ("techniques/flexmoe/vexpert_base.py", "SlotBalancer.state_dict"): "checkpoint save (numpy state)",
    ("techniques/eplb/eplb.py", "keep_in_place"): "numpy slot tables, between iterations",
    ("techniques/eplb/eplb.py", "EPLB.state_dict"): "checkpoint save (numpy state)",
    ("techniques/lancet/lancet_partition.py", "ForwardPartitioner.measure"): "start-up measurement (synchronized)",
    ("techniques/node_dedup/node_dedup.py", "NodeDedup.dispatch"): "host routing table and to_host_all's result",
    ("techniques/parm/parm.py", "ParmSchedule._expert_split"): "the kept counts' host copy (read with the counts)",
}


def _host_read_sites():
    """{(module, function): [call]} of every call named in HOST_READS under moe/, techniques/,
    model/, except numpy's (np.*) and reads of to_host's result."""
    found = {}

    def visit(node, scope, module):
        for child in ast.iter_child_nodes(node):
            inner = scope + [child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else scope
            if isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                base = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                if name in HOST_READS and not base.startswith(("np", "numpy", "to_host", "host_sync.to_host")):
                    found.setdefault((module, ".".join(scope)), []).append(f"{base}.{name}" if base else name)
            visit(child, inner, module)

    for sub in ("moe", "techniques", "model"):
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            module = path.relative_to(PACKAGE).as_posix()
            if module not in HOST_MODULES:
                visit(ast.parse(path.read_text()), [], module)
    return found


def test_no_bare_host_reads_in_the_hot_paths():
    found = _host_read_sites()
    bare = {key: calls for key, calls in found.items() if key not in ALLOWED}
    assert not bare, f"host reads of possibly device data: route them through perf/host_sync.py: {bare}"
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"allow-list entries without a host read any more (remove them): {stale}"
    assert all((PACKAGE / module).exists() for module in HOST_MODULES)


# -- capacity_keep (item 7) ------------------------------------------------------------------------
def _one_hot_keep(expert_ids, num_experts, capacity, prior_counts=None):
    """The formula capacity_keep had: a [n, k, E] one-hot."""
    chose = F.one_hot(expert_ids, num_experts).sum(1)  # [n, E]
    position = chose.cumsum(0) - chose
    if prior_counts is not None:
        position = position + prior_counts
    return position.gather(1, expert_ids) < capacity


def _random_ids(gen, n, k, num_experts, skew):
    scores = torch.rand(n, num_experts, generator=gen)
    scores[:, : max(1, num_experts // 4)] += skew  # ties: many tokens on the same few experts
    return scores.topk(k, dim=-1).indices


def test_capacity_keep_sort_equals_one_hot():
    gen = torch.Generator().manual_seed(0)
    for n, k, num_experts in [(1, 1, 1), (5, 1, 3), (17, 2, 4), (64, 4, 8), (33, 3, 16), (200, 8, 64), (7, 6, 6)]:
        for skew in (0.0, 2.0):
            ids = _random_ids(gen, n, k, num_experts, skew)
            for capacity in {0, 1, 2, max(1, n * k // num_experts), n * k}:
                expected = _one_hot_keep(ids, num_experts, capacity)
                assert torch.equal(capacity_keep(ids, num_experts, capacity), expected), (n, k, num_experts, capacity)
                prior = torch.randint(0, 3, (num_experts,), generator=gen)
                assert torch.equal(capacity_keep(ids, num_experts, capacity, prior),
                                   _one_hot_keep(ids, num_experts, capacity, prior))
    assert capacity_keep(ids, num_experts, None).all()


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op produced."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_capacity_keep_memory_does_not_grow_with_experts_per_token():
    n, k, num_experts = 256, 4, 256  # a one-hot would be n k E = 262144 elements
    ids = _random_ids(torch.Generator().manual_seed(1), n, k, num_experts, 1.0)
    with _Largest() as largest:
        capacity_keep(ids, num_experts, 4, torch.ones(num_experts, dtype=torch.long))
    assert largest.numel <= max(n * k, num_experts + 1), largest.numel
    with _Largest() as old:
        _one_hot_keep(ids, num_experts, 4)
    assert old.numel == n * k * num_experts  # what the test would catch


# -- on a GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(LAYERS)))
def test_gpu_layer_forward_syncs_only_in_the_helper(case):
    """`make test-gpu`: a baseline layer's forward and backward on CUDA under sync debug mode
    "error": any sync but the helper's one copy of the counts raises."""
    layer = _layer(*LAYERS[case], device="cuda")
    x = torch.randn(2, 6, 8, device="cuda", requires_grad=True)
    layer(x)  # warm-up: the grouped GEMM's one-time kernel probe
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with HOST_SYNCS.counting() as helper:
            y, aux = layer(x)
            ((y * y.detach()).sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert helper.reads == 1

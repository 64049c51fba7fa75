"""Gradient sync and the global grad norm against single-process references.

1. Hand-made parameters with ParamMeta (tp-sharded, tp-replicated, experts sharded over ep and
   esp, an expert bias replicated over esp, all replicated over dp / edp): each rank's raw gradient
   is a known slice of a per-replica full tensor, so the synced gradient and the global norm have
   exact expected values (the norm counts every parameter once: no double counting of replicas).
2. The real GPT-MoE model: one global batch on 8 ranks (tensor=2 expert=2 expert_shard=2, dp 4,
   edp 2) and on 4 ranks (expert=2 expert_shard=2, esp != tp) gives the same synced gradients and
   grad norm as one process; on 4 ranks (tensor=2 expert=2: SAA needs an MP group) so does the
   same model with full activation recomputation (`training.recompute=full`) under s2 + SAA with
   FasterMoE replicas: its MoE layers run their all-to-alls again in backward and replay the
   placements planned in forward.
"""
import math
import zlib

import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.training.grads import GradSync
from tests.distributed import harness
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

METAS = {
    "col.weight": ParamMeta("dense", (8, 6), [(0, "tp")]),
    "col.bias": ParamMeta("dense", (8,), [(0, "tp")]),
    "row.weight": ParamMeta("dense", (6, 8), [(1, "tp")]),
    "norm.weight": ParamMeta("dense", (6,)),  # replicated over tp
    "router.weight": ParamMeta("dense", (4, 6)),  # replicated over tp
    "experts.w1": ParamMeta("expert", (4, 6, 8), [(0, "ep"), (2, "esp")]),
    "experts.w2": ParamMeta("expert", (4, 8, 6), [(0, "ep"), (1, "esp")]),
    "experts.b2": ParamMeta("expert", (4, 6), [(0, "ep")]),  # replicated over esp
}


def _full(name, *key):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name,) + key).encode()))
    return torch.randn(METAS[name].global_shape, generator=gen, dtype=torch.float64)


def _replica_grad(name, state):
    """Full raw gradient this rank computed: per data replica (dense: dp rank, expert: edp rank),
    plus a zero-mean perturbation across the compute group a replicated param is averaged over."""
    meta = METAS[name]
    replica = state.dp.rank if meta.kind == "dense" else state.edp.rank
    g = _full(name, "replica", replica)
    compute = {"dense": "tp", "expert": "esp"}[meta.kind]
    if compute not in meta.sharded_groups():
        group = state.groups[compute]
        g = g + (group.rank - (group.size - 1) / 2) * _full(name, "perturb")
    return g


def _expected_grad(name, state):
    """What every copy must hold after sync: mean over dp of the dense replicas; sum over the edp
    replicas / dp_size for experts."""
    meta = METAS[name]
    replicas = state.dp_size if meta.kind == "dense" else state.edp_size
    return sum(_full(name, "replica", r) for r in range(replicas)) / state.dp_size


def _check_handmade(state):
    params = [(n, make_param(m, state)) for n, m in METAS.items()]
    results = {}
    for bucket_bytes in (1 << 20, 64):  # one bucket per kind of sync / many small buckets
        for name, p in params:
            p.grad = _replica_grad(name, state)[p.meta.local_slices(state)].float()
        sync = GradSync(params, state, bucket_bytes=bucket_bytes)
        C.COMM_STATS.reset()
        sync.sync()
        results[bucket_bytes] = dict(C.COMM_STATS.calls)
        for name, p in params:
            torch.testing.assert_close(p.grad, _expected_grad(name, state)[p.meta.local_slices(state)].float(),
                                       rtol=1e-5, atol=1e-6, msg=name)
    expected_norm = math.sqrt(sum(float(_expected_grad(n, state).pow(2).sum()) for n in METAS))
    norm = sync.grad_norm()
    assert norm == pytest.approx(expected_norm, rel=1e-5), (norm, expected_norm)
    # the classic bug: summing every rank's local squared norm counts replicas several times
    naive = C.all_reduce(torch.tensor([sum(float(p.grad.double().pow(2).sum()) for _, p in params)]),
                         state.world).sqrt().item()
    before = {n: p.grad.clone() for n, p in params}
    assert sync.clip(norm / 4) == pytest.approx(norm, rel=1e-6)
    for name, p in params:
        torch.testing.assert_close(p.grad, before[name] / 4, rtol=1e-5, atol=1e-7)
    assert sync.grad_norm() == pytest.approx(norm / 4, rel=1e-5)
    assert sync.clip(norm) == pytest.approx(norm / 4, rel=1e-5)  # below the limit: unchanged
    torch.testing.assert_close(params[0][1].grad, before[params[0][0]] / 4)
    return results, norm, naive


def _trainer_grads(cfg, state):
    from megatron_moe.training.trainer import Trainer

    trainer = Trainer(cfg, state)
    sums, _ = trainer.forward_backward(0)
    trainer.grads.sync()
    loss, aux = trainer.mean_over_dp(sums, trainer.num_micro_batches)[:2]
    # numpy: tensors would travel between processes as shared-memory handles that die with the worker
    grads = {n: (p.meta.local_slices(state), p.grad.cpu().numpy().copy()) for n, p in trainer.model.named_parameters()}
    return loss, aux, trainer.grads.grad_norm(), grads


def _model_config(layout, extra=()):
    """The tiny GPT-MoE on this process's backend (a spawned worker's, else gloo: the CPU)."""
    return load_config("configs/gpt_moe_tiny.yaml", [
        "model.seq_length=16", "training.micro_batch_size=2", "training.global_batch_size=8",
        "moe.num_experts=4", "moe.z_loss_coeff=0.001", f"parallel.backend={harness.backend()}"]
        + [f"parallel.{k}={v}" for k, v in layout.items()] + list(extra))


RECOMPUTE = ["training.recompute=full", "moe.schedule=s2", "moe.saa=true", "moe.balancer=fastermoe",
             "moe.fastermoe.min_shadow=1", "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"]
RECOMPUTE_LAYOUT = dict(tensor=2, expert=2)  # on the 4 ranks (moe.saa=true with s2 needs parallel.tensor > 1)


def _check_all(state, layout):
    handmade = _check_handmade(state)
    runs = [_trainer_grads(_model_config(layout), state)]
    if state.world_size == 4:
        sub = ParallelState.build(RankLayout(world_size=4, **RECOMPUTE_LAYOUT), state.rank)
        runs.append(_trainer_grads(_model_config(RECOMPUTE_LAYOUT, RECOMPUTE), sub))
    return (handmade, *runs)


@pytest.mark.parametrize("world,layout", [
    (8, dict(tensor=2, expert=2, expert_shard=2)),
    (4, dict(expert=2, expert_shard=2)),
])
def test_grad_sync_and_norm_match_single_process(world, layout):
    outs = run_distributed(world, _check_all, layout, args=(layout,))
    (calls, norm, naive) = outs[0][0]
    # bucketed: one all-reduce per (group, bucket), not one per parameter
    big = calls[1 << 20]
    assert sum(v for k, v in big.items() if k.startswith("all_reduce/")) < len(METAS)
    assert sum(calls[64].values()) > sum(big.values())
    assert naive > norm * 1.2  # the double-counting norm differs clearly from the right one

    ref_loss, ref_aux, ref_norm, ref_grads = _trainer_grads(_model_config({}), ParallelState.single_process())
    for rank, (loss, aux, norm, grads) in [(r, run) for r, out in enumerate(outs) for run in out[1:]]:
        assert loss == pytest.approx(ref_loss, rel=1e-5) and aux == pytest.approx(ref_aux, rel=1e-4, abs=1e-7)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        assert grads.keys() == ref_grads.keys()
        for name, (slices, grad) in grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(ref_grads[name][1][slices]),
                                       rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")

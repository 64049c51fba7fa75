"""Multi-head latent attention (`model.attention: mla`, model/mla.py) in the Trainer on 4 ranks against
one process: the tiny GPT-MoE with MLA and YaRN (mscale_all_dim: the softmax factor), one global batch,
synced gradients, loss, aux loss and grad norm, on

* tensor=2 expert=2 (dp 2): heads split over TP, experts over EP;
* tensor=2 expert=2 with selective recomputation (the core attention runs again in backward);
* tensor=2 (dp 2, no expert parallelism);

all at fp32's exactness tolerance (tests/distributed/test_grads.py's), and tensor=2 expert=2 in bf16
against the single-process bf16 run at tests/distributed/test_bf16.py's tolerances (loss 2u, grad
norm 8u). The down projections and their norms are TP-replicated: every TP rank's synced gradient
equals the single-process one (their gradient is whole on each rank before the sync; model/mla.py).
On gloo (the CPU) and on NCCL (`make test-gpu`: 4 GPUs, against one process on the test's GPU).
"""
import pytest
import torch

from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from tests.distributed.harness import BACKENDS, require_gpus, run_distributed
from tests.distributed.test_bf16 import LOSS_RTOL, NORM_RTOL
from tests.distributed.test_grads import _model_config

pytestmark = pytest.mark.distributed

MLA = ["model.position_embedding=rope", "model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=12",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=12", "model.bias=false",
       "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
       "model.rope_scaling.original_max_position_embeddings=8", "model.rope_scaling.mscale_all_dim=1.0"]
TP_EP = dict(tensor=2, expert=2)
JOBS = {  # name: (layout, extra overrides)
    "tp2-ep2": (TP_EP, []),
    "tp2-ep2-selective": (TP_EP, ["training.recompute=selective"]),
    "tp2": (dict(tensor=2), []),
    "tp2-ep2-bf16": (TP_EP, ["training.precision=bf16"]),
}


def _run(cfg, state):
    """(loss, aux, grad norm, {name: (slices, grad)}; None in bf16) of one global batch."""
    from megatron_moe.training.trainer import Trainer
    trainer = Trainer(cfg, state)
    sums, _ = trainer.forward_backward(0)
    trainer.grads.sync()
    loss, aux = trainer.mean_over_dp(sums, trainer.num_micro_batches)[:2]
    grads = None
    if cfg.training.precision == "fp32":  # numpy: tensors would travel as shared-memory handles
        grads = {n: (p.meta.local_slices(state), p.grad.cpu().numpy().copy())
                 for n, p in trainer.model.named_parameters()}
    return loss, aux, trainer.grads.grad_norm(), grads


def _check_jobs(state):
    out = {}
    for name, (layout, extra) in JOBS.items():
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank)
        out[name] = _run(_model_config(layout, MLA + extra), sub)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_matches_single_process_on_tp_and_ep(backend):
    if backend == "nccl":
        require_gpus(4)  # before the single-GPU references
    outs = run_distributed(4, _check_jobs, dict(tensor=2, expert=2), backend=backend)
    single = ParallelState.single_process()  # nccl: one process on this process's GPU
    refs = {precision: _run(_model_config({}, MLA + [f"training.precision={precision}", f"parallel.backend={backend}"]),
                            single) for precision in ("fp32", "bf16")}
    for rank, out in enumerate(outs):
        for name, (loss, aux, norm, grads) in out.items():
            ref_loss, ref_aux, ref_norm, ref_grads = refs["bf16" if name.endswith("bf16") else "fp32"]
            if grads is None:
                assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL), (name, rank)
                assert norm == pytest.approx(ref_norm, rel=NORM_RTOL), (name, rank)
                continue
            assert loss == pytest.approx(ref_loss, rel=1e-5) and aux == pytest.approx(ref_aux, rel=1e-4, abs=1e-7)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, rank)
            assert grads.keys() == ref_grads.keys()
            assert any("attention.kv_down.weight" in n for n in grads)
            for pname, (slices, grad) in grads.items():
                torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(ref_grads[pname][1][slices]),
                                           rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=pname, r=rank, j=name: f"{j} rank {r} {n}: {m}")

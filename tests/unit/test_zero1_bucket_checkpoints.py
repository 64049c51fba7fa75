"""ZeRO-1 checkpoints across bucket layouts (issue #44 item 6): with `optimizer.grad_bucket_mb` the
distributed optimizer holds one flat buffer per bucket; its AdamW state is saved per parameter
(`sharded_states`), so a checkpoint of many small buckets resumes into one large bucket, or into
plain AdamW, and continues as the run that never stopped."""
import pytest

from megatron_moe.training.distributed_optimizer import DistributedOptimizer
from tests.unit.test_checkpoint import train

SMALL = ["optimizer.distributed=true", "optimizer.grad_bucket_mb=0.01"]  # ~10 KB buckets: many flat buffers


@pytest.mark.parametrize("resume_with", [SMALL, ["optimizer.distributed=true"], ["optimizer.distributed=false"]])
def test_zero1_bucketed_checkpoint_resumes_across_bucket_layouts(tmp_path_factory, resume_with):
    saved = tmp_path_factory.mktemp("saved")
    reference = train(saved, SMALL + ["checkpoint.save_interval=2"])
    resumed = train(tmp_path_factory.mktemp("resumed"), resume_with + [f"checkpoint.load={saved}/ckpt/iter_0000002"])
    assert [r[0] for r in resumed] == [3, 4]
    if resume_with == SMALL:
        assert resumed == reference[2:]  # bit for bit
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(resumed, reference[2:]):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6) and norm == pytest.approx(ref_norm, rel=1e-5)


def test_small_buckets_make_several_flat_buffers(tmp_path):
    from megatron_moe.distributed.parallel_state import ParallelState
    from megatron_moe.model.gpt import GPTMoEModel
    from tests.unit.test_checkpoint import config

    cfg = config(tmp_path, SMALL)
    opt = DistributedOptimizer(GPTMoEModel(cfg, ParallelState.single_process()), cfg.optimizer,
                               ParallelState.single_process())
    assert len(opt.flats) > 4  # the test above crosses bucket layouts

"""Checkpoints across layouts (issue 4): save under tensor=2 expert=2 expert_shard=2 (8 processes),
load under 1 process and under expert=4 (4 processes), continue training: the losses of the
continued iterations match the uninterrupted 8-process run (rel 1e-5), and `load_model` gives
the same logits as the 8-process model. On gloo, and on NCCL with a GPU per rank (`make test-gpu`:
saved from GPUs, loaded on one GPU, on 4 and by `load_model` on the CPU)."""
import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.checkpoint_io import read_metadata
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets
from tests.distributed.harness import BACKENDS, run_distributed

pytestmark = pytest.mark.distributed

OVERRIDES = ["training.train_iters=3", "training.log_interval=1", "training.eval_interval=0",
             "training.micro_batch_size=1", "training.global_batch_size=8", "model.seq_length=16",
             "model.dropout=0.0", "logging.tensorboard=false", "optimizer.warmup_iters=1",
             "model.normalization=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope",
             "model.bias=false", "model.tie_embeddings=false", "model.vocab_size=125"]  # odd: padded under tp=2


def _config(tmp, layout, extra=()):
    par = [f"parallel.{k}={v}" for k, v in layout.items()]
    return load_config("configs/gpt_moe_tiny.yaml", OVERRIDES + par + [
        f"training.run_dir={tmp}/run_{'_'.join(map(str, layout.values())) or 'single'}",
        f"checkpoint.dir={tmp}/ckpt"] + list(extra))


def _train(state, tmp, layout, extra, tokens):
    trainer = Trainer(_config(tmp, layout, extra), state, datasets=synthetic_datasets)
    losses = [r["loss"] for r in trainer.train()]
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model.gather_logits(trainer.model(tokens.to(trainer.device)).logits)
    return losses, logits.cpu()


LAYOUT_8 = dict(tensor=2, expert=2, expert_shard=2)
LAYOUT_4 = dict(expert=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_8_ranks_resume_on_1_and_4(tmp_path, backend):
    tokens = torch.randint(0, 125, (2, 16), generator=torch.Generator().manual_seed(0))
    on = [f"parallel.backend={backend}"]
    # uninterrupted 8-process run, checkpoints at iterations 2 and 3 (the last); the logits after
    # iteration 3 depend on the AdamW moments restored at iteration 2
    out8 = run_distributed(8, _train, LAYOUT_8, (str(tmp_path), LAYOUT_8, on + ["checkpoint.save_interval=2",
                                                                               "checkpoint.keep_last=0"], tokens),
                           backend=backend)
    ref_losses, ref_logits = out8[0]
    ckpt2 = tmp_path / "ckpt" / "iter_0000002"
    md = read_metadata(str(ckpt2)).state_dict_metadata
    assert len(md["model/final_norm.weight"].chunks) == 1  # replicated on 8 ranks, written once
    assert len(md["optim/layers.0.ffn.experts.w1/exp_avg"].chunks) == 4  # ep x esp shards (edp=2 copies: once)
    assert [tuple(c.sizes) for c in md["model/embedding.word.weight"].chunks] == [(63, 64), (62, 64)]  # 126 padded
    resume = on + [f"checkpoint.load={ckpt2}", "checkpoint.save_interval=0"]
    # 1 process
    losses1, logits1 = _train(ParallelState.single_process(), str(tmp_path), {}, resume, tokens)
    assert len(losses1) == 1 and losses1 == pytest.approx(ref_losses[2:], rel=1e-5)
    # 4 processes, expert=4
    out4 = run_distributed(4, _train, LAYOUT_4, (str(tmp_path), LAYOUT_4, resume, tokens), backend=backend)
    assert out4[0][0] == pytest.approx(ref_losses[2:], rel=1e-5)
    torch.testing.assert_close(out4[0][1], ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits1, ref_logits, rtol=1e-5, atol=1e-5)
    # load_model on the final 8-process checkpoint reproduces the 8-process model's logits
    from megatron_moe import load_model

    model = load_model(str(tmp_path / "ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref_logits, rtol=1e-5, atol=1e-5)
    assert model(tokens).shape == (2, 16, 125) and not model.training

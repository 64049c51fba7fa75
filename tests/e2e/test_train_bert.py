"""pretrain_bert_moe.py on the embedded corpus (sentence level): MLM + sentence-order losses fall,
and the same seed gives the same losses and grad norm on 1 process and under tensor=2 and
expert=2 x expert_shard=2 (gloo; ranks forked with torchrun's environment: test_train_cli.launch_ranks)."""
import json
import math

import pytest

from tests.e2e.test_train_cli import launch_ranks

pytestmark = pytest.mark.e2e

CONFIG = ["--config", "configs/bert_moe_tiny.yaml"]
INVARIANCE = ["training.train_iters=3", "training.log_interval=1", "training.eval_interval=0",
              "training.micro_batch_size=1", "training.global_batch_size=4", "model.seq_length=32",
              "model.dropout=0.0", "moe.capacity_factor=null", "optimizer.warmup_iters=1"]


def train(nproc, overrides, run_dir):
    """`pretrain_bert_moe.py` on `nproc` ranks, forked as test_train_cli.launch_ranks does."""
    proc = launch_ranks(nproc, overrides + [f"training.run_dir={run_dir}"], timeout=400, script="pretrain_bert_moe.py",
                        config=CONFIG)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_bert_losses_fall(tmp_path):
    records = train(1, ["training.train_iters=30", "training.log_interval=10", "training.eval_interval=0"], tmp_path)
    assert [r["iteration"] for r in records] == [1, 10, 20, 30]
    assert records[0]["loss"] == pytest.approx(math.log(1024), rel=0.05)  # untrained MLM: ~uniform
    assert records[0]["binary_loss"] == pytest.approx(math.log(2), rel=0.05)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(1, INVARIANCE, tmp_path_factory.mktemp("bert_ref"))


@pytest.mark.parametrize("nproc,layout", [
    (2, ["parallel.tensor=2"]),
    (4, ["parallel.expert=2", "parallel.expert_shard=2"]),
], ids=["tp2", "ep2-esp2"])
def test_bert_layout_invariance(reference, nproc, layout, tmp_path):
    records = train(nproc, INVARIANCE + layout, tmp_path)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference] == [1, 2, 3]
    for ref, got in zip(reference, records):
        for key, rel in (("loss", 1e-4), ("binary_loss", 1e-4), ("aux_loss", 1e-4), ("grad_norm", 1e-3)):
            assert got[key] == pytest.approx(ref[key], rel=rel), (key, ref, got)
    assert reference[-1]["loss"] != reference[0]["loss"]

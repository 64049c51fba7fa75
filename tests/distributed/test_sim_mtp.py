"""The cluster simulator's bytes equal real runs' counters with multi-token prediction and MLA
(issue #45's model features; megatron_moe/sim/, docs/simulator.md).

Whole iterations of the Trainer (GPT, 4 gloo processes, a node per 2 ranks), replayed from their
routing traces as tests/distributed/test_sim_bytes.py's pipeline runs (`check_replay`): every rank's
every counter of each iteration equals the simulator's.

* MTP on pipeline 2 x expert 2 with an untied output layer: the last stage's copy of the word table
  and its gradient sum over `embedding`, the MTP layer's MoE all-to-alls and Pro-Prophet's
  Trans / Agg for it on the last stage, the second output-layer pass;
* two MTP depths with dense FFNs (`moe.layer_pattern` [1, 0]) on tensor 2 x expert 2 in bf16: the
  depths' word lookups, eh_proj's all-gather and input-gradient all-reduce, the heads' and losses'
  tensor-parallel sums;
* MLA on tensor 2 x expert 2, with a query down-projection (and an MTP depth, FasterMoE) and
  without: the replicated down projections' averages over tp in the gradient sync and the
  input gradients of q_up (q), kv_up and the shared rotary key, all-reduced over tp backward.
"""
import pytest

from tests.distributed.harness import run_distributed
from tests.distributed.test_sim_bytes import NODE, _train_pipeline, check_replay

pytestmark = pytest.mark.distributed
PP2_EP2 = ["parallel.pipeline=2", "parallel.expert=2"]
TP2_EP2 = ["parallel.tensor=2", "parallel.expert=2"]
MLA = ["model.attention=mla", "model.position_embedding=rope", "model.normalization=rmsnorm", "model.bias=false",
       "model.kv_lora_rank=12", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6"]
RUNS = {  # name: (RankLayout kwargs, overrides on test_sim_bytes.PIPELINE_COMMON)
    "mtp-pp2-untied-proprophet": (dict(pipeline=2, expert=2), PP2_EP2 + [
        "model.num_layers=2", "model.mtp_depth=1", "model.tie_embeddings=false", "moe.balancer=proprophet",
        "moe.proprophet.min_replicas=1"]),
    "mtp2-tp2-dense-bf16": (dict(tensor=2, expert=2), TP2_EP2 + [
        "model.num_layers=2", "model.mtp_depth=2", "moe.layer_pattern=[1,0]", "training.precision=bf16"]),
    "mla-tp2-mtp-fastermoe": (dict(tensor=2, expert=2), TP2_EP2 + MLA + [
        "model.num_layers=1", "model.q_lora_rank=10", "model.mtp_depth=1", "moe.balancer=fastermoe",
        "moe.fastermoe.min_shadow=1"]),
    "mla-tp2-no-q-lora": (dict(tensor=2, expert=2), TP2_EP2 + MLA + ["model.num_layers=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the runs' directory, [rank] {run: per-iteration counters}) from one spawn of 4 processes."""
    tmp = str(tmp_path_factory.mktemp("sim_mtp"))
    return tmp, run_distributed(4, _train_pipeline, NODE, (tmp, RUNS), timeout=600)


@pytest.mark.parametrize("name", list(RUNS))
def test_simulated_bytes_equal_the_real_counters_mtp_mla(runs, name):
    check_replay(*runs, name, RUNS)

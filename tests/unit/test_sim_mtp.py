"""The simulator's model of issue #45's features (megatron_moe/sim/model.py, sim/runner.py): MLA's
attention FLOPs by hand, sliding windows' (unchanged: the cores compute every score, masked),
multi-token prediction's ops on the last stage, its MoE layer and the word table's copy.
Bytes against real runs: tests/distributed/test_sim_mtp.py."""
import numpy as np
import pytest

from megatron_moe.config import load_config
from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.model import DenseModel
from megatron_moe.sim.ops import traffic_of
from megatron_moe.sim.runner import Simulation

PROFILE = "configs/hardware/cpu_gloo_2proc.yaml"
TINY = ["model.num_layers=2", "model.hidden_size=16", "model.num_attention_heads=4", "model.seq_length=8",
        "model.vocab_size=64", "model.position_embedding=rope", "model.normalization=rmsnorm", "model.bias=false",
        "moe.num_experts=4", "moe.top_k=2", "training.micro_batch_size=1", "training.global_batch_size=4",
        "perf.hardware_profile=" + PROFILE]
MLA = ["model.attention=mla", "model.kv_lora_rank=12", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
       "model.v_head_dim=6"]


def _sim(tmp_path, overrides, world=4):
    return Simulation(load_config(None, TINY + overrides), load_profile(PROFILE), world, str(tmp_path))


@pytest.mark.parametrize("q_lora", [None, 10])
def test_mla_attention_flops_and_tp_gradients_by_hand(tmp_path, q_lora):
    """h 16, 4 heads, s 8, tp 2: the heads' projections and cores split over tp, q_down / kv_down whole."""
    sim = _sim(tmp_path, MLA + ["parallel.tensor=2"] + ([f"model.q_lora_rank={q_lora}"] if q_lora else []))
    dense = sim.stages[0].dense
    h, a, s, qk, v, kr, rope = 16, 4, 8, 12, 6, 12, 4
    q = q_lora * a * qk if q_lora else h * a * qk
    sharded = q + kr * a * (8 + v) + a * v * h + s * a * (qk + v)
    replicated = (h * q_lora if q_lora else 0) + h * (kr + rope)
    assert dense.attention_flops == pytest.approx(2 * sharded / 2 + 2 * replicated)
    fwd, bwd = dense.attention()
    n = sim.tokens
    assert traffic_of(fwd)["all_reduce/tp"][0] == n * h * 4  # proj's output
    assert traffic_of(bwd)["all_reduce/tp"][0] == n * ((q_lora or h) + kr + rope) * 4  # q_up (q), kv_up, k^R


def test_standard_attention_flops_and_sliding_windows(tmp_path):
    """GQA by hand; a sliding window leaves them as they are (documented: masked, not skipped)."""
    base = _sim(tmp_path / "a", ["model.num_query_groups=2", "parallel.tensor=2"]).stages[0].dense
    h, a, d, g, s = 16, 4, 4, 2, 8
    assert base.attention_flops == pytest.approx((2 * (h * (a + 2 * g) * d + a * d * h) + 2 * 2 * s * a * d) / 2)
    window = _sim(tmp_path / "b", ["model.num_query_groups=2", "parallel.tensor=2", "model.sliding_window=2",
                                   "model.attention_sinks=true"]).stages[0].dense
    assert window.attention_flops == base.attention_flops


def _ops_by_label(ops):
    return [(label, [op.name for op in sub]) for label, sub, _ in ops]


def test_mtp_runs_on_the_last_stage_with_its_moe_layer_and_the_word_tables_sum(tmp_path):
    """pp 2 x ep 2, 2 layers + 2 MTP depths (MoE, as the last layer), untied: the depths after the
    output layer on stage 1, MoE layers 2 and 3 there (each issuing its own Trans), and the word
    table's gradient summed over `embedding` on both stages; none of it without MTP."""
    over = ["parallel.pipeline=2", "parallel.expert=2", "model.tie_embeddings=false"]
    sim = _sim(tmp_path / "mtp", over + ["model.mtp_depth=2"])
    assert sim.moe_layers == [0, 1, 2, 3] and sim.stage_of == {0: 0, 1: 1, 2: 1, 3: 1}
    assert {2, 3} <= sim.first_in_chunk
    counts = np.full((4, 2, 4), 2)  # [L, dp, E]
    acc = {"traffic": {}, "inter": {}, "layers": [{"rows": np.zeros((1, 2)), "replicas": 0.0, "forwards": 0,
                                                   "schedules": {}, "plan_s": 0.0} for _ in range(4)]}
    last = sim.chunk_ops(1, 0, counts, acc)
    assert [label for label, _, _ in last.mtp] == ["mtp2", "dense2", "moe2", "mtp2", "mtp3", "dense3", "moe3", "mtp3"]
    assert [op.name for op in last.mtp[0][1]] == ["eh_proj"] and last.mtp[3][1][0].name == "head"
    assert not sim.chunk_ops(0, 0, counts, acc).mtp
    result = sim.run(sim.trace("uniform", 1).steps(), limit=1)[0]
    assert len(result.layers) == 4 and all(layer.seconds > 0 for layer in result.layers)
    word = 64 * 16 * 4  # the padded vocabulary x h, fp32 gradients, on every rank of both stages
    np.testing.assert_array_equal(sim.traffic[0]["all_reduce/embedding"], np.full(4, word))
    plain = _sim(tmp_path / "plain", over)
    assert plain.run(plain.trace("uniform", 1).steps(), limit=1)[0].seconds < result.seconds
    assert "all_reduce/embedding" not in plain.traffic[0]

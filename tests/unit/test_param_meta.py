"""ParamMeta's shards written out by hand, rank by rank (not with `local_slices`, which the baseline and
reference tests use to shard their own weights, so a bug there would hide in both sides), and
`init_from_seed_` giving each rank exactly its hand-sliced piece of the 1-process tensor."""
import pytest
import torch

from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.tensor_parallel.param_meta import ParamMeta, init_from_seed_, make_param

S = slice
# E = 4 experts, hidden h = 8, expert FFN input width W = 16, FFN 8; dense: out 16, in 8 / out 8, in 16
METAS = {
    "w1": ParamMeta("expert", (4, 8, 16), [(0, "ep"), (2, "esp")]),
    "w2": ParamMeta("expert", (4, 8, 8), [(0, "ep"), (1, "esp")]),
    "b2": ParamMeta("expert", (4, 8), [(0, "ep"), (1, "esp")]),
    "column": ParamMeta("dense", (16, 8), [(0, "tp")]),  # column-parallel weight [out, in]
    "row": ParamMeta("dense", (8, 16), [(1, "tp")]),  # row-parallel weight [out, in]
}

# world 8, tensor 2, expert 2, expert_shard 2 (parallel_state.py's worked example):
#   rank      0  1  2  3  4  5  6  7
#   tp_rank   0  1  0  1  0  1  0  1
#   esp_rank  0  1  0  1  0  1  0  1
#   ep_rank   0  0  1  1  0  0  1  1      (ranks 4-7: edp rank 1, the copies of ranks 0-3)
# experts: EP rank q holds experts [2q, 2q + 2); ESP rank s holds half s of the sharded dim
# (w1: FFN columns [8s, 8s + 8) of W 16; w2: FFN rows [4s, 4s + 4) of 8; b2: outputs [4s, 4s + 4) of 8);
# dense: TP rank t holds rows [8t, 8t + 8) of column's 16, columns [8t, 8t + 8) of row's 16.
HAND_TP2_EP2_ESP2 = {
    0: dict(w1=(S(0, 2), S(0, 8), S(0, 8)), w2=(S(0, 2), S(0, 4), S(0, 8)), b2=(S(0, 2), S(0, 4)),
            column=(S(0, 8), S(0, 8)), row=(S(0, 8), S(0, 8))),
    1: dict(w1=(S(0, 2), S(0, 8), S(8, 16)), w2=(S(0, 2), S(4, 8), S(0, 8)), b2=(S(0, 2), S(4, 8)),
            column=(S(8, 16), S(0, 8)), row=(S(0, 8), S(8, 16))),
    2: dict(w1=(S(2, 4), S(0, 8), S(0, 8)), w2=(S(2, 4), S(0, 4), S(0, 8)), b2=(S(2, 4), S(0, 4)),
            column=(S(0, 8), S(0, 8)), row=(S(0, 8), S(0, 8))),
    3: dict(w1=(S(2, 4), S(0, 8), S(8, 16)), w2=(S(2, 4), S(4, 8), S(0, 8)), b2=(S(2, 4), S(4, 8)),
            column=(S(8, 16), S(0, 8)), row=(S(0, 8), S(8, 16))),
}
HAND_TP2_EP2_ESP2.update({rank + 4: HAND_TP2_EP2_ESP2[rank] for rank in range(4)})  # edp copies: same coordinates

# world 8, tensor 2, expert 2, expert_shard 4: esp != tp, so an esp/tp mix-up shows.
#   rank      0  1  2  3  4  5  6  7
#   tp_rank   0  1  0  1  0  1  0  1
#   esp_rank  0  1  2  3  0  1  2  3
#   ep_rank   0  0  0  0  1  1  1  1
# w1: experts [2q, 2q + 2), FFN columns [4s, 4s + 4) of 16.
HAND_TP2_EP2_ESP4 = {
    0: dict(w1=(S(0, 2), S(0, 8), S(0, 4)), column=(S(0, 8), S(0, 8))),
    1: dict(w1=(S(0, 2), S(0, 8), S(4, 8)), column=(S(8, 16), S(0, 8))),
    2: dict(w1=(S(0, 2), S(0, 8), S(8, 12)), column=(S(0, 8), S(0, 8))),
    3: dict(w1=(S(0, 2), S(0, 8), S(12, 16)), column=(S(8, 16), S(0, 8))),
    4: dict(w1=(S(2, 4), S(0, 8), S(0, 4)), column=(S(0, 8), S(0, 8))),
    5: dict(w1=(S(2, 4), S(0, 8), S(4, 8)), column=(S(8, 16), S(0, 8))),
    6: dict(w1=(S(2, 4), S(0, 8), S(8, 12)), column=(S(0, 8), S(0, 8))),
    7: dict(w1=(S(2, 4), S(0, 8), S(12, 16)), column=(S(8, 16), S(0, 8))),
}


@pytest.mark.parametrize("layout,hand", [
    (RankLayout(world_size=8, tensor=2, expert=2, expert_shard=2), HAND_TP2_EP2_ESP2),
    (RankLayout(world_size=8, tensor=2, expert=2, expert_shard=4), HAND_TP2_EP2_ESP4),
], ids=["tp2-ep2-esp2", "tp2-ep2-esp4"])
def test_local_slices_and_seeded_init_by_hand(layout, hand):
    seed = 7
    single = ParallelState.single_process()
    full = {}  # the whole tensor, drawn on 1 process
    for name in hand[0]:
        p = make_param(METAS[name], single)
        init_from_seed_(p, name, seed, single)
        full[name] = p.detach().clone()
        assert full[name].shape == METAS[name].global_shape and full[name].abs().sum() > 0
    for rank in range(layout.world_size):
        state = ParallelState.build(layout, rank)  # no process group: torch.distributed is not initialized
        for name, slices in hand[rank].items():
            meta = METAS[name]
            where = f"rank {rank} {name}"
            assert meta.local_slices(state) == slices, where
            assert meta.offsets(state) == tuple(s.start for s in slices), where
            assert meta.local_shape(state) == tuple(s.stop - s.start for s in slices), where
            p = make_param(meta, state)
            init_from_seed_(p, name, seed, state)
            assert torch.equal(p.detach(), full[name][slices]), where  # layout-independent init

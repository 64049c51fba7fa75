"""Baseline schedule (Parm Fig. 3(a)) == single-process reference, and Parm Eq. (1)'s volumes.

Each spawn runs every case of `moe_cases.CASES` on one layout and checks it against the reference
(`moe_cases.check_against_reference`). Every data-parallel rank has its own tokens. On gloo, and
on NCCL with a GPU per rank (`make test-gpu`).
"""

import pytest
import torch

from megatron_moe.distributed.parallel_state import RankLayout
from tests.distributed.harness import BACKENDS, run_distributed
from tests.distributed.moe_cases import (B, CASES, E, H, S, balanced_layer_comm, case_config, case_data,
                                         check_against_reference, run_layer)

LAYOUTS = [
    (2, dict(tensor=2)),
    (2, dict(expert=2)),
    (4, dict(expert=2)),  # + data parallel 2
    (8, dict(tensor=2, expert=2, expert_shard=2)),  # Parm Fig. 2: N_MP = N_EP = N_ESP = 2
    (8, dict(expert=4, expert_shard=2)),
]


def _run_cases(state, check_comm):
    results = [run_layer(state, *case_data(index, state.dp_size)) for index in range(len(CASES))]
    comm = balanced_layer_comm(state, case_config(0)) if check_comm else None
    return results, comm


def _check_eq1_volumes(forward, backward, layout: RankLayout):
    """Parm Eq. (1) per rank, bytes = 4 x elements (fp32). B L = B*S tokens per rank, M = H,
    T = k B L / E tokens per expert (dropless and perfectly balanced: f = 1), N_ESP = esp.
    Counters (distributed/collectives.py): an all-gather counts its gathered output, an
    all-reduce its tensor, an all-to-all this rank's whole input."""
    k, esp, ep, fp32, i64 = 2, layout.expert_shard, layout.expert, 4, 8
    blm = B * S * H
    etm = E * (k * B * S // E) * H
    assert forward == {
        "all_gather/esp": fp32 * blm * esp,  # AG_ESP(BLM x N_ESP): ESP-AllGather of the tokens
        "all_to_all/ep": 2 * fp32 * etm * esp,  # 2 x A2A_EP(ETM x N_ESP): dispatch + return
        "all_reduce/esp": fp32 * etm * esp,  # AR_ESP(ETM x N_ESP): partial sums of the ESP shards
        # routing metadata, beside Eq. (1): expert ids and combine weights of the ESP group's
        # tokens (their counts are the config's); per-expert counts of every EP rank (the splits)
        "all_gather_routing/esp": (i64 + fp32) * B * S * k * esp,
        "all_gather_counts/ep": i64 * E * ep,
    }
    # backward: ESP-Split -> all-gather of dy; both all-to-alls reversed; ESP-AllReduce -> none
    # (identity); ESP-AllGather -> reduce-scatter of the tokens' gradient
    assert backward == {
        "all_gather/esp": fp32 * blm * esp,
        "all_to_all/ep": 2 * fp32 * etm * esp,
        "reduce_scatter/esp": fp32 * blm * esp,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=lambda v: str(v))
def test_baseline_layer_equals_reference(world, layout_kwargs, backend):
    layout = RankLayout(world_size=world, **layout_kwargs)
    check_comm = layout.tensor * layout.expert_shard > 1 and layout.expert > 1
    outputs = run_distributed(world, _run_cases, layout_kwargs, args=(check_comm,), backend=backend)
    for index in range(len(CASES)):
        refs = check_against_reference([out[0][index] for out in outputs], index, layout, "baseline")
        for rank in range(world):
            # computed per EP rank: kept assignments of every rank of this ep_esp group (TP copies included)
            group_kept = torch.tensor([refs[layout.coords(q)["dp"]].kept_per_expert
                                       for q in layout.group_of("ep_esp", rank)]).sum(0)
            stats = outputs[rank][0][index]["stats"]
            assert stats.tokens_per_ep_rank.tolist() == group_kept.view(layout.expert, -1).sum(1).tolist()
            assert stats.schedule == "baseline"
    if check_comm:
        for forward, backward in (out[1] for out in outputs):
            _check_eq1_volumes(forward, backward, layout)

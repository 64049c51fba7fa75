"""NCCL's rules, checked on gloo processes (issue #44 items 1 and 2; on NCCL with `make test-gpu`).

1. Every tensor entering a collective lives on the group's device: each built group knows it (gloo:
   the CPU), and a real gloo group declared to live elsewhere refuses the CPU tensors on every rank
   before communicating (tests/unit/test_group_device.py covers every op and the call sites).
2. The first batched point-to-point call on a communicator includes every rank: a side channel is
   warmed up when it is built (one ring exchange, counted as kind `warm_up`), after which a round of
   vExpert moves that only some EP ranks take part in completes, bit for bit; calibration's `p2p`
   pairs leave the last rank of an odd group out, so every rank's first batched call on `ep` and on
   `world` is the warm-up ring, all ranks together. gloo does not care, so the tests assert the
   warm-up itself: the counters, and each rank's first `batch_isend_irecv` per communicator.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import WARM_UP, ParallelState, RankLayout
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.vexpert_moves import MovesInFlight
from megatron_moe.moe.vexperts import expert_rows
from megatron_moe.tensor_parallel.param_meta import init_from_seed_
from tests.distributed.harness import BACKENDS, device, run_distributed
from tests.distributed.moe_cases import case_config

SUBSET_MOVE = [[0, -1], [1, -1], [2, -1], [3, 2]]  # from the owners' table: rank 3 gains expert 2 from rank 2


def _device_and_subset_moves(state):
    out = {"device": {name: (g.size, g.device) for name, g in state.groups.items()}}
    # 1: a real group declared to live on another device refuses CPU tensors (every rank, no traffic)
    declared = replace(state.world, device=torch.device("meta"))
    for op in (lambda t: C.all_reduce(t, declared), lambda t: C.all_gather(t, declared),
               lambda t: C.p2p_exchange([((declared.rank + 1) % 4, t)], [], declared)):
        with pytest.raises(RuntimeError, match="backend needs meta"):
            op(torch.ones(2, device=device()))
    assert C.all_reduce(torch.ones(1, device=device()), state.world).item() == 4  # the real one still works
    # 2: a fresh side channel is warmed up when built; then a round of moves between ranks 2 and 3 only
    C.COMM_STATS.reset()
    sub = ParallelState.build(RankLayout(world_size=4, expert=4), state.rank, side_channels=["ep"])
    out["after_build"] = (dict(C.COMM_STATS.calls), C.COMM_STATS.snapshot(), dict(C.COMM_STATS.received))
    experts = Experts(case_config(1), sub, slots_per_rank=2)
    for name, p in experts.named_parameters():
        init_from_seed_(p, name, 7, sub)
    experts.to(device())
    before = {e: [p[k].clone() for p in experts.stacks()] for k, e in expert_rows(experts.slot_table)}
    C.COMM_STATS.reset()
    MovesInFlight(experts, np.array(SUBSET_MOVE), None, sub.ep).complete()
    out["moves"] = dict(C.COMM_STATS.calls)
    out["before"] = before
    out["after"] = {e: [p[k].clone() for p in experts.stacks()] for k, e in expert_rows(experts.slot_table)}
    out["side_handle"] = sub.ep.side_handle is not None
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_group_devices_and_a_first_round_of_moves_on_a_subset_of_ranks(backend_name):
    outs = run_distributed(4, _device_and_subset_moves, backend=backend_name)
    for rank, out in enumerate(outs):
        want = torch.device("cpu") if backend_name == "gloo" else torch.device("cuda", rank)
        assert {name for name, (size, _) in out["device"].items() if size > 1} == {"dp", "edp", "world"}
        for name, (size, dev) in out["device"].items():  # a group of one rank: no process group, no device
            assert dev == (want if size > 1 else None), (rank, name, dev)
        calls, nbytes, received = out["after_build"]
        # one warm-up ring on the side channel, every rank: one fp32 element sent, one received
        assert calls == {f"{WARM_UP}/ep": 1} and nbytes == {f"{WARM_UP}/ep": 4}, (rank, calls, nbytes)
        assert received == {f"{WARM_UP}/ep": 4} and out["side_handle"]
        # the round: only EP ranks 2 (sends expert 2) and 3 (receives it) post point-to-point ops
        assert out["moves"] == ({"vexpert_move/ep": 1} if rank in (2, 3) else {}), (rank, out["moves"])
    for e, tensors in outs[3]["after"].items():  # rank 3 holds 3 and 2 now, 2 bit for bit as rank 2 had it
        source = outs[e]["before"][e]
        assert all(torch.equal(a, b) for a, b in zip(tensors, source)), e
    assert sorted(outs[3]["after"]) == [2, 3]


def _calibrate_p2p_first_calls(state):
    """Calibration's p2p on `ep` and `world` of 3 ranks (odd: rank 2 has no partner); each rank's
    first batch_isend_irecv per communicator -> the peers it talks to there."""
    from megatron_moe.training.calibrate import measure_links, measure_points

    names = {id(state.ep.handle): "ep", id(state.world.handle): "world"}
    first = {}
    real = C.dist.batch_isend_irecv

    def spy(ops):
        name = names.get(id(ops[0].group))
        if name is not None and name not in first:
            first[name] = sorted({op.peer for op in ops})
        return real(ops)

    C.dist.batch_isend_irecv = spy
    try:
        C.COMM_STATS.reset()
        measure_points(state, [128], 1, device(), ops=("p2p",))
        measure_links(state, [128], 1, device())
    finally:
        C.dist.batch_isend_irecv = real
    return first, dict(C.COMM_STATS.calls)


@pytest.mark.distributed
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_calibration_p2p_on_an_odd_group_warms_up_every_rank_first(backend_name):
    outs = run_distributed(3, _calibrate_p2p_first_calls, dict(expert=3), backend=backend_name)
    for name in ("ep", "world"):
        firsts = [out[0].get(name) for out in outs]
        assert all(f is not None for f in firsts), (name, firsts)  # every rank's first call ...
        for r, peers in enumerate(firsts):  # ... is the same ring: each of its peers' first call talks to it
            assert peers == sorted({(r + 1) % 3, (r - 1) % 3}), (name, r, peers)
            assert all(r in firsts[p] for p in peers), (name, r, peers)
        assert all(out[1][f"{WARM_UP}/{name}"] >= 1 for out in outs), name

"""Persistent vExpert slots (moe/vexperts.py, moe/vexpert_moves.py; FlexMoE, EPLB) == the
single-process reference.

1. Every schedule executes a slot placement unchanged: a fixed slot table with an expert on
   several EP ranks, a second vExpert of one expert on the same rank and a free slot; the MoE
   layer's output, aux loss, input gradient and (after `before_grad_sync`, the holders of an
   expert summing their gradients) every stored row's gradient equal the reference of the expert
   it holds. A rank stores one row per expert it holds (FlexMoE §3.1): the byte count of its
   stacks is its distinct experts x one expert's bytes, however many vExperts of one it has. The
   gradient sum runs among each shared expert's holders only: every holder ends with the same bits,
   and each rank sends and receives exactly the bytes of the slot table (per shared expert it
   holds, k holders: the k - 1 chunks it does not sum, and k - 1 copies of the one it sums);
   a rank holding no shared expert sends and receives nothing.
2. Moves carry AdamW state exactly, in flight: after two identical optimizer steps a round of
   moves to a table that needs Expand, Migrate (a cell's expert leaving it while another comes
   in) and Shrink is issued (on ``ep``'s side channel, as best-effort training builds it), every
   layer run of item 1 (all-to-alls, all-gathers, SAA, the smart schedule's point-to-point
   messages on the same groups) runs while it is in flight (`moe.flexmoe.moves: best_effort`), and
   only then is it completed: weights and both moments arrive bit for bit, with the bytes of the
   formula.
3. In bf16 (`training.precision: bf16`, MixedPrecisionAdamW) the same round carries each moved
   expert's fp32 master bit for bit, with the bf16 weights and both moments: after two steps the
   masters hold bits below bf16's, so a master re-made from the bf16 weight (`weight.float()`) on
   the destination would differ.
4. With edp > 1 (expert=2 on 4 ranks: two copies of every expert) items 1-3 hold per ep group, and
   a decision sees the window averaged over the edp groups: FlexMoE's and EPLB's one all-reduce of
   the host-built window, on edp's device (issue #44 item 1: NCCL has no CPU tensors).

Every test runs on gloo and, with `make test-gpu`, on NCCL (one process per GPU).
"""
import numpy as np
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.tensor_parallel.param_meta import init_from_seed_
from megatron_moe.model.precision import cast_params_
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.vexpert_moves import MovesInFlight, entry_tensor, reshape_storage, state_entries
from megatron_moe.moe.vexperts import expert_rows
from megatron_moe.training.mixed_precision import MixedPrecisionAdamW
from tests.distributed.harness import BACKENDS, device, per_world_spawner
from tests.distributed.moe_cases import B, E, FP32, H, S, case_config, case_data, check_results, reference
from tests.distributed.test_moe_parm import TESTBED_B

LAYOUTS = [(2, dict(expert=2)), (4, dict(expert=4)), (4, dict(tensor=2, expert=2, expert_shard=2)),
           (4, dict(expert=2))]  # edp 2
IDS = ["ep2", "ep4", "tp2-ep2-esp2", "ep2-edp2"]
TABLES = {  # slots per EP rank (E = 4); -1 = free
    2: [[0, 1, 3], [2, 3, 3]],  # expert 3 on both ranks, twice on rank 1 (one stored row)
    4: [[0, 1], [1, 0], [2, 1], [3, -1]],  # expert 1 on 3 ranks, 0 on 2; rank 3 holds no shared one
}
MOVES = {  # table after the initial (owners') one
    2: [[0, 3, 2], [2, 3, 1]],  # 3 and 2 to rank 0, 1 to rank 1: expert 1 migrates
    4: [[3, 0], [1, 2], [-1, 0], [1, -1]],  # rank 0 keeps 0 and gains 3; 2 leaves rank 2, 3 leaves rank 3
}
RUNS = [  # (schedule, saa, smart, case)
    ("baseline", False, False, 0), ("baseline", False, False, 1), ("s1", False, False, 2),
    ("s2", False, False, 0), ("s2", True, False, 1), ("auto", True, False, 3),
    ("baseline", False, True, 1), ("s2", False, True, 0),
    ("s1", False, False, 4), ("baseline", False, True, 5),  # router variants + shared experts (moe_cases.VARIANTS)
]


def _slot_config(index: int, schedule: str, saa: bool, smart: bool, ep: int, token_dispatch: str = "per_copy"):
    cfg, full, xs, gs = case_data(index, 1)
    cfg.moe.schedule, cfg.moe.saa, cfg.moe.smart_schedule = schedule, saa, smart
    cfg.moe.token_dispatch = token_dispatch
    cfg.perf.hardware_profile = TESTBED_B
    cfg.moe.balancer = "eplb"  # slots (E + redundant) / ep; the table is set by hand below
    cfg.moe.eplb.redundant_slots = len(TABLES[ep][0]) * ep - E
    return cfg, full


def layer_run(sub: ParallelState, run, token_dispatch: str = "per_copy"):
    """One MoE layer on TABLES[ep]'s slots: run = (schedule, saa, smart, case)."""
    schedule, saa, smart, index = run
    cfg, full = _slot_config(index, schedule, saa, smart, sub.ep_size, token_dispatch)
    _, _, xs, gs = case_data(index, sub.dp_size)
    layer = MoELayer(cfg, sub, layer_index=0)
    reshape_storage(layer.experts, TABLES[sub.ep_size])
    rows = expert_rows(layer.experts.slot_table)  # [(row, expert)]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            slices = p.meta.local_slices(sub)
            if hasattr(p, "vexpert_slots"):
                for k, e in rows:
                    p[k].copy_(full[name][e][slices[1:]])
            else:
                p.copy_(full[name][slices])
    layer.to(device())
    d = sub.layout.coords(sub.rank)["dp"]
    x = xs[d].clone().to(device()).requires_grad_(True)
    y, aux = layer(x)
    ((y * gs[d].to(device())).sum() + aux).backward()
    key = "vexpert_grad/ep"
    before = (C.COMM_STATS.bytes.get(key, 0), C.COMM_STATS.received.get(key, 0), C.COMM_STATS.calls.get(key, 0))
    layer.balancer.before_grad_sync()  # what the trainer does before the data-parallel all-reduce
    after = (C.COMM_STATS.bytes.get(key, 0), C.COMM_STATS.received.get(key, 0), C.COMM_STATS.calls.get(key, 0))
    grad_sum = [b - a for a, b in zip(before, after)]  # (sent, received, calls)
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}  # not the expert bias
    one_expert = sum(full[n][0][p.meta.local_slices(sub)[1:]].numel() * 4 for n, p in params.items()
                     if hasattr(p, "vexpert_slots"))  # bytes of one expert's shard, every stack
    return dict(y=y.detach(), aux=aux.detach(), dx=x.grad, stats=layer.last_stats, rows=rows,
                grads={n: p.grad for n, p in params.items()}, grad_sum=grad_sum,
                meta={n: (p.meta.kind, p.meta.local_slices(sub)) for n, p in params.items()},
                slot_params=[n for n, p in params.items() if hasattr(p, "vexpert_slots")],
                stack_bytes=sum(p.numel() * p.element_size() for p in layer.experts.stacks()), one_expert=one_expert)


def _issue_moves(sub: ParallelState, bf16: bool = False):
    """Two AdamW steps on identical per-expert gradients, then a round of moves to MOVES[ep],
    issued (in flight) -> (experts, optimizer, the round, the state before it per expert).
    `bf16`: bf16 stacks stepped by MixedPrecisionAdamW (fp32 masters, gradients in `main_grad`)."""
    cfg = case_config(1)  # swiglu + biases: every kind of expert stack
    experts = Experts(cfg, sub, slots_per_rank=len(TABLES[sub.ep_size][0]))
    for name, p in experts.named_parameters():
        init_from_seed_(p, name, 7, sub)
    experts.to(device())
    if bf16:
        cast_params_(experts, "bf16")
        optimizer = MixedPrecisionAdamW([{"params": list(experts.parameters()), "weight_decay": 0.1}], lr=0.1,
                                        betas=(0.9, 0.999), eps=1e-8)
    else:
        optimizer = torch.optim.AdamW(experts.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    rows = expert_rows(experts.slot_table)
    for step in range(2):
        for name, p in experts.named_parameters():
            full = torch.randn((E,) + tuple(p.meta.global_shape[1:]),
                               generator=torch.Generator().manual_seed(step * 10 + len(name)))
            slices = p.meta.local_slices(sub)
            grad = torch.stack([full[e][slices[1:]] for _, e in rows]).to(p.device)
            if bf16:
                p.main_grad.copy_(grad)
            else:
                p.grad = grad
        optimizer.step()
    entries = state_entries(experts.stacks(), optimizer)
    before = {e: [entry_tensor(x, optimizer)[k].clone() for x in entries] for k, e in rows}
    C.COMM_STATS.reset()
    return experts, optimizer, MovesInFlight(experts, MOVES[sub.ep_size], optimizer, sub.ep), before


def _complete_moves(experts, optimizer, moves, before):
    sent = C.COMM_STATS.snapshot().get("vexpert_move/ep", 0)  # counted when issued
    moves.complete()
    entries = state_entries(experts.stacks(), optimizer)
    after = {e: [entry_tensor(x, optimizer)[k].clone() for x in entries] for k, e in expert_rows(experts.slot_table)}
    width = sum(entry_tensor(x, optimizer)[0].numel() for x in entries)
    return dict(before=before, after=after, crossed=moves.crossed, width=width, bytes=sent,
                rows=[p.shape[0] for p in experts.stacks()], slots=experts.slot_table.slots.tolist(),
                keys=[key for _, key in entries])


def _decision_window(sub: ParallelState):
    """Item 4: `after_optimizer_step` on a decision iteration, with a window of this rank's own
    (whole numbers: the sums are exact) -> (that window, the one `decide` was given)."""
    cfg, _ = _slot_config(0, "baseline", False, False, sub.ep_size)
    balancer = MoELayer(cfg, sub, layer_index=0).balancer
    window = (np.arange(balancer.window.size).reshape(balancer.window.shape) + 1) * (sub.rank + 1.0)
    balancer.window[:] = window
    seen = []
    balancer.decide = lambda w: seen.append(w.copy())  # None: no moves
    balancer.after_optimizer_step(balancer.interval, None)
    return window, seen[0]


def _run(state, jobs):
    out = []
    for kwargs in jobs:
        # the moves travel on ep's side channel, as the trainer builds it for best-effort moves
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank, side_channels=["ep"])
        in_flight = _issue_moves(sub)  # best-effort: every layer run below happens while it is in flight
        layers = [layer_run(sub, run) for run in RUNS]
        out.append(dict(layers=layers, move=_complete_moves(*in_flight), side_channel=sub.ep.side_handle is not None,
                        move_bf16=_complete_moves(*_issue_moves(sub, bf16=True)),
                        window=_decision_window(sub) if sub.edp_size > 1 else None))
    return out


@pytest.fixture(scope="module")
def spawned():
    return per_world_spawner(LAYOUTS, _run)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=IDS)
def test_slot_placements_equal_reference_under_every_schedule(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    for i, (schedule, saa, smart, index) in enumerate(RUNS):
        check_slot_results([out["layers"][i] for out in outputs], layout, index,
                           f"{schedule} saa={saa} smart={smart} case {index}")


def check_slot_results(results, layout: RankLayout, index: int, label: str) -> None:
    """Every rank's `layer_run` result against the reference of case `index`: outputs, dense
    gradients, and each stored row's gradient summed over its expert's holders."""
    slot_names = results[0]["slot_params"]
    assert slot_names  # the expert stacks are slots
    dense = [dict(r, meta={n: m for n, m in r["meta"].items() if n not in slot_names}) for r in results]
    reference_output = reference(index, layout.data_parallel)
    check_results(dense, reference_output, layout, label)
    ref_grads = reference_output[2]
    for rank, res in enumerate(results):
        assert res["stats"].replicas == sum(1 for row in TABLES[layout.expert] for e in row if e >= 0) - E
        held = sorted({e for e in TABLES[layout.expert][layout.coords(rank)["ep"]] if e >= 0})
        assert [e for _, e in res["rows"]] == held  # one row per expert held: k vExperts, one copy
        assert res["stack_bytes"] == len(held) * res["one_expert"], (rank, res["stack_bytes"])
        # the gradient sum's traffic, from the slot table: expert e's k holders H cut its W
        # elements into k chunks (the first W mod k one longer), chunk j summed by H[(e + j) mod k];
        # a holder sends every other chunk's root its part and receives its own chunk's parts
        # from the k - 1 others, then sends its summed chunk to them and receives theirs
        table, q, width = TABLES[layout.expert], layout.coords(rank)["ep"], res["one_expert"] // 4
        each_way = 0
        for e in range(E):
            holders = [p for p in range(layout.expert) if e in table[p]]
            k = len(holders)
            if k > 1 and q in holders:
                own = sum(width // k + (j < width % k) for j in range(k) if holders[(e + j) % k] == q)
                each_way += (width - own) + (k - 1) * own
        sent, received, calls = res["grad_sum"]
        assert (sent, received) == (each_way * 4,) * 2, (label, rank, res["grad_sum"], each_way)
        assert calls == (2 if each_way else 0), (label, rank, calls)  # a non-holder posts nothing
        for other in layout.group_of("ep", rank):  # the copies of an expert carry the same bits
            for k, e in res["rows"]:
                for k2, e2 in results[other]["rows"]:
                    if e2 == e:
                        for name in slot_names:
                            assert torch.equal(res["grads"][name][k], results[other]["grads"][name][k2]), \
                                (label, rank, other, name, e)
        for name in slot_names:
            slices = res["meta"][name][1]
            edp = layout.group_of("edp", rank)
            for k, e in res["rows"]:
                synced = sum(results[q]["grads"][name][k] for q in edp) / layout.data_parallel
                torch.testing.assert_close(synced, ref_grads[name][e][slices[1:]], **FP32,
                                           msg=lambda m: f"{label} rank {rank} {name} row {k} (expert {e}): {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=IDS)
def test_moves_in_flight_carry_weights_and_adam_moments_exactly(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    new = MOVES[layout.expert]
    per_rank = E // layout.expert
    old = [set(range(q * per_rank, (q + 1) * per_rank)) for q in range(layout.expert)]  # the owners' layout
    # every rank gains the experts of its new row it did not hold, each from its only old holder
    gains = [(q, e) for q in range(layout.expert) for e in sorted({e for e in new[q] if e >= 0} - old[q])]
    assert gains  # the round moves something
    sent = [sum(1 for _, e in gains if e in old[q]) for q in range(layout.expert)]
    assert all(out["side_channel"] for out in outputs)
    for group in layout.groups("ep"):  # one ESP shard (and data-parallel copy) per group
        moves = [outputs[r]["move"] for r in group]
        source = {}
        for move in moves:
            for e, tensors in move["before"].items():
                source[e] = tensors  # one holder per expert before the round
        assert len(next(iter(moves[0]["before"].values()))) == 3 * 4  # w1 w2 b1 b2, each + 2 moments
        for q, move in enumerate(moves):
            held = sorted({e for e in new[q] if e >= 0})
            assert move["slots"] == new and sorted(move["after"]) == held
            assert move["rows"] == [len(held)] * 4  # the stacks follow the rank's experts
            for e in held:
                for got, want in zip(move["after"][e], source[e]):
                    assert torch.equal(got, want), (q, e)
        assert all(m["crossed"] == len(gains) for m in moves)  # every rank counts them all
        for q, move in enumerate(moves):
            assert move["bytes"] == sent[q] * move["width"] * 4, (q, move["bytes"])


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=IDS)
def test_bf16_moves_carry_the_fp32_masters_bit_for_bit(world, layout_kwargs, backend, spawned):
    """Item 3 of the module docstring: every expert a rank holds after the round (gained by Expand
    or Migrate, or kept) has its source's bf16 weights, moments and fp32 master bit for bit; each
    master carries bits below bf16's (so `weight.float()` in its place would fail), and rounds to
    its weight."""
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    new, per_rank = MOVES[layout.expert], E // layout.expert
    for group in layout.groups("ep"):
        moves = [outputs[r]["move_bf16"] for r in group]
        keys = moves[0]["keys"]
        assert keys == [None] * 4 + ["exp_avg", "exp_avg_sq", "master"] * 4  # w1 w2 b1 b2, their state
        weight_of = {i: keys.index(None) + (i - 4) // 3 for i, key in enumerate(keys) if key == "master"}
        source = {e: tensors for move in moves for e, tensors in move["before"].items()}  # one holder each
        gained = 0
        for q, move in enumerate(moves):
            assert move["slots"] == new
            for e, tensors in move["after"].items():
                gained += e // per_rank != q
                for i, (got, want) in enumerate(zip(tensors, source[e])):
                    assert got.dtype == want.dtype and torch.equal(got, want), (q, e, keys[i])
                for i, w in weight_of.items():
                    master, weight = tensors[i], tensors[w]
                    assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
                    assert torch.equal(master.bfloat16(), weight) and not torch.equal(master, weight.float()), (q, e)
        assert gained == moves[0]["crossed"] > 0  # the round moved experts (Expand and Migrate)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_decision_window_is_the_mean_over_edp(backend, spawned):
    """Item 4: every rank decides on the mean of its edp group's windows (bit for bit)."""
    world, layout_kwargs = LAYOUTS[IDS.index("ep2-edp2")]
    layout = RankLayout(world_size=world, **layout_kwargs)
    assert layout.expert_data_parallel == 2
    outputs = spawned(world, backend)[str(layout_kwargs)]
    for rank, out in enumerate(outputs):
        group = layout.group_of("edp", rank)
        want = sum(outputs[q]["window"][0] for q in group) / len(group)
        assert np.array_equal(out["window"][1], want), (rank, out["window"][1], want)
        assert not np.array_equal(want, out["window"][0])  # the ranks' windows differ: a real mean

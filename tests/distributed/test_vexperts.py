"""Persistent vExpert slots (moe/vexperts.py; FlexMoE, EPLB) == the single-process reference.

1. Every schedule executes a slot placement unchanged: a fixed slot table with an expert on
   several EP ranks, a second copy of one expert on the same rank and a free slot; the MoE layer's
   output, aux loss, input gradient and (after `before_grad_sync`, the slots of an expert summing
   their gradients) every slot's gradient equal the reference of the expert it holds.
2. Moves carry AdamW state exactly: after two identical optimizer steps, `relocate` to a table
   that needs Expand, Migrate (a cell's expert leaving it while another comes in) and Shrink moves
   weights and both moments bit for bit, with the bytes of the formula.
"""
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.model.param_meta import init_from_seed_
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.vexperts import optimizer_tensors, relocate
from tests.distributed.harness import BACKENDS, device, per_world_spawner
from tests.distributed.moe_cases import B, E, FP32, H, S, case_config, case_data, check_results, reference
from tests.distributed.test_moe_parm import TESTBED_B

LAYOUTS = [(2, dict(expert=2)), (4, dict(expert=4)), (4, dict(tensor=2, expert=2, expert_shard=2))]
TABLES = {  # slots per EP rank (E = 4); -1 = free
    2: [[0, 1, 3], [2, 3, 3]],  # expert 3 on both ranks, twice on rank 1
    4: [[0, 2], [1, 0], [2, -1], [3, 0]],  # expert 0 on 3 ranks, 2 on 2; rank 1 computes slot 1 first
}
MOVES = {  # (table after the initial one, cells that must cross ranks)
    2: [[0, 3, 2], [2, 3, 1]],  # 3 and 2 to rank 0, 1 to rank 1: expert 1 migrates
    4: [[3, 0], [1, 2], [-1, 0], [1, -1]],  # rank 0's 0 moves within the rank while 3 arrives; 2 leaves rank 2
}
RUNS = [  # (schedule, saa, smart, case)
    ("baseline", False, False, 0), ("baseline", False, False, 1), ("s1", False, False, 2),
    ("s2", False, False, 0), ("s2", True, False, 1), ("auto", True, False, 3),
    ("baseline", False, True, 1), ("s2", False, True, 0),
    ("s1", False, False, 4), ("baseline", False, True, 5),  # router variants + shared experts (moe_cases.VARIANTS)
]


def _slot_config(index: int, schedule: str, saa: bool, smart: bool, ep: int):
    cfg, full, xs, gs = case_data(index, 1)
    cfg.moe.schedule, cfg.moe.saa, cfg.moe.smart_schedule = schedule, saa, smart
    cfg.perf.hardware_profile = TESTBED_B
    cfg.moe.balancer = "eplb"  # slots (E + redundant) / ep; the table is set by hand below
    cfg.moe.eplb.redundant_slots = len(TABLES[ep][0]) * ep - E
    return cfg, full


def _layer_run(sub: ParallelState, run):
    schedule, saa, smart, index = run
    cfg, full = _slot_config(index, schedule, saa, smart, sub.ep_size)
    _, _, xs, gs = case_data(index, sub.dp_size)
    layer = MoELayer(cfg, sub, layer_index=0)
    layer.experts.slot_table.slots = layer.experts.slot_table.checked(TABLES[sub.ep_size])
    row = layer.experts.slot_table.slots[sub.ep.rank].tolist()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            slices = p.meta.local_slices(sub)
            if hasattr(p, "vexpert_slots"):
                for k, e in enumerate(row):
                    if e >= 0:
                        p[k].copy_(full[name][e][slices[1:]])
            else:
                p.copy_(full[name][slices])
    layer.to(device())
    d = sub.layout.coords(sub.rank)["dp"]
    x = xs[d].clone().to(device()).requires_grad_(True)
    y, aux = layer(x)
    ((y * gs[d].to(device())).sum() + aux).backward()
    layer.balancer.before_grad_sync()  # what the trainer does before the data-parallel all-reduce
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}  # not the expert bias
    return dict(y=y.detach(), aux=aux.detach(), dx=x.grad, stats=layer.last_stats, row=row,
                grads={n: p.grad for n, p in params.items()},
                meta={n: (p.meta.kind, p.meta.local_slices(sub)) for n, p in params.items()},
                slot_params=[n for n, p in params.items() if hasattr(p, "vexpert_slots")])


def _move_run(sub: ParallelState):
    """Two AdamW steps on identical per-expert gradients, then `relocate` to MOVES[ep]."""
    cfg = case_config(1)  # swiglu + biases: every kind of expert stack
    experts = Experts(cfg, sub, slots_per_rank=len(TABLES[sub.ep_size][0]) if sub.ep_size in TABLES else None)
    for name, p in experts.named_parameters():
        init_from_seed_(p, name, 7, sub)
    experts.to(device())
    optimizer = torch.optim.AdamW(experts.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    table = experts.slot_table
    row = table.slots[sub.ep.rank].tolist()
    for step in range(2):
        for name, p in experts.named_parameters():
            full = torch.randn((E,) + tuple(p.meta.global_shape[1:]),
                               generator=torch.Generator().manual_seed(step * 10 + len(name)))
            slices = p.meta.local_slices(sub)
            rows = [full[e][slices[1:]] if e >= 0 else torch.zeros(p.shape[1:]) for e in row]
            p.grad = torch.stack(rows).to(p.device)
        optimizer.step()
    params = experts.stacks()
    before = {e: [t[k].clone() for t in optimizer_tensors(params, optimizer)] for k, e in enumerate(row) if e >= 0}
    C.COMM_STATS.reset()
    crossed = relocate(table, MOVES[sub.ep_size], optimizer_tensors(params, optimizer), sub.ep)
    after = [[t[k].clone() for t in optimizer_tensors(params, optimizer)] for k in range(table.shape[1])]
    width = sum(t[0].numel() for t in optimizer_tensors(params, optimizer))
    return dict(before=before, after=after, crossed=crossed, width=width, bytes=C.COMM_STATS.snapshot())


def _run(state, jobs):
    out = []
    for kwargs in jobs:
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank)
        out.append(dict(layers=[_layer_run(sub, run) for run in RUNS], move=_move_run(sub)))
    return out


@pytest.fixture(scope="module")
def spawned():
    return per_world_spawner(LAYOUTS, _run)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "ep4", "tp2-ep2-esp2"])
def test_slot_placements_equal_reference_under_every_schedule(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    for i, (schedule, saa, smart, index) in enumerate(RUNS):
        label = f"{schedule} saa={saa} smart={smart} case {index}"
        results = [out["layers"][i] for out in outputs]
        slot_names = results[0]["slot_params"]
        assert slot_names  # the expert stacks are slots
        dense = [dict(r, meta={n: m for n, m in r["meta"].items() if n not in slot_names}) for r in results]
        reference_output = reference(index, layout.data_parallel)
        check_results(dense, reference_output, layout, label)
        ref_grads = reference_output[2]
        for rank, res in enumerate(results):
            assert res["stats"].replicas == sum(1 for row in TABLES[layout.expert] for e in row if e >= 0) - E
            for name in slot_names:
                slices = res["meta"][name][1]
                edp = layout.group_of("edp", rank)
                for k, e in enumerate(res["row"]):
                    if e < 0:
                        continue
                    synced = sum(results[q]["grads"][name][k] for q in edp) / layout.data_parallel
                    torch.testing.assert_close(synced, ref_grads[name][e][slices[1:]], **FP32,
                                               msg=lambda m: f"{label} rank {rank} {name} slot {k} (expert {e}): {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "ep4", "tp2-ep2-esp2"])
def test_moves_carry_weights_and_adam_moments_exactly(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    new = MOVES[layout.expert]
    for group in layout.groups("ep"):  # one ESP shard (and data-parallel copy) per group
        moves = [outputs[r]["move"] for r in group]
        source = {}
        for move in moves:
            for e, tensors in move["before"].items():
                if e in source:  # identical copies before the move (same steps on the same gradients)
                    for a, b in zip(tensors, source[e]):
                        assert torch.equal(a, b)
                source.setdefault(e, tensors)
        assert len(moves[0]["before"][next(iter(moves[0]["before"]))]) == 3 * 4  # w1 w2 b1 b2, each + 2 moments
        for q, move in enumerate(moves):
            for k, e in enumerate(new[q]):
                if e >= 0:
                    for got, want in zip(move["after"][k], source[e]):
                        assert torch.equal(got, want), (q, k, e)
        old = [[q * (E // layout.expert) + j if j < E // layout.expert else -1 for j in range(len(new[0]))]
               for q in range(layout.expert)]
        sent = [sum(1 for q2 in range(layout.expert) for k, e in enumerate(new[q2])
                    if e >= 0 and e != old[q2][k] and e not in old[q2] and _source(old, e, new) == q)
                for q in range(layout.expert)]
        assert sum(m["crossed"] for m in moves) == layout.expert * sum(sent)  # every rank counts them all
        for q, move in enumerate(moves):
            assert move["bytes"].get("vexpert_move/ep", 0) == sent[q] * move["width"] * 4, (q, move["bytes"])


def _source(old, e, new):
    """The rank `plan_transfers` takes expert e from in these tables (its only old holder)."""
    holders = [q for q, row in enumerate(old) if e in row]
    assert len(holders) == 1
    return holders[0]

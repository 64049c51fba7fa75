"""Parm S1, S2 (AAS and SAA) and auto == single-process reference; Parm's communication volumes.

One spawn per world size runs, for each of its layouts, every schedule on the cases of
`moe_cases` (dropless and capacity 1.0 with drops); each layout's test checks outputs, aux loss,
input and ALL parameter gradients, routing statistics and the computed load. `auto` gets, per case, a profile whose Alg. 1 threshold lies between the
data-parallel micro-batches' dispatched assignments, so that TP groups of one `ep_esp` group pick
different schedules (with SAA); the pick is checked against the closed form. The volume
check replays perfectly balanced routing and compares every counter with Parm's analysis.
"""
import pytest
import torch

from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.hardware import HardwareProfile, save_profile
from tests.distributed.harness import run_distributed
from tests.distributed.moe_cases import (B, E, H, S, balanced_layer_comm, case_config, case_data,
                                         check_against_reference, reference, run_layer)

RUNS = [  # (moe.schedule, moe.saa, case index): each schedule dropless and with capacity drops
    ("s1", False, 0), ("s1", False, 1), ("s1", False, 2),
    ("s2", False, 0), ("s2", False, 2),
    ("s2", True, 1), ("s2", True, 3),
    ("auto", True, 0), ("auto", True, 1), ("auto", False, 2), ("auto", False, 3),
]
COMM_RUNS = [("s1", False), ("s2", False), ("s2", True)]
LAYOUTS = [  # (world, layout, check volumes)
    (8, dict(tensor=2, expert=2, expert_shard=2), True),
    (4, dict(tensor=2, expert=2), False),
    (8, dict(tensor=2, expert=4), False),
    (8, dict(tensor=4, expert=2), True),
    (4, dict(expert=2, expert_shard=2), True),
    (8, dict(tensor=2, expert=2, expert_shard=4), False),  # each ESP group spans two TP groups
    (8, dict(tensor=4, expert=2, expert_shard=2), False),  # each ESP group inside a TP group
]


def _dispatched(kept_per_expert, ep: int) -> int:
    """Alg. 1's E T of a micro-batch: N_EP x the kept assignments of its busiest EP rank."""
    return ep * max(sum(kept_per_expert[q * E // ep:(q + 1) * E // ep]) for q in range(ep))


def _threshold_profiles(layout: RankLayout, tmp_path):
    """Per auto case: a profile path and the expected pick per data-parallel rank. With alpha = 0,
    beta_A2A = 0, beta_AG = 1 and beta_o = b, Eq. 13/14 give t_D1 = B S H and, with SAA,
    t_D2 = b (E T) H N_ESP / N_MP: S1 iff E T >= theta = B S N_MP / (b N_ESP); b puts theta
    between the micro-batches' E T. With AAS, t_D2 = (E T) H: S1 iff E T >= B S."""
    out = {}
    for schedule, saa, index in RUNS:
        if schedule != "auto":
            continue
        refs, _, _ = reference(index, layout.data_parallel)
        loads = [_dispatched(ref.kept_per_expert, layout.expert) for ref in refs]
        low, high = min(loads), max(loads)
        theta = (low + high) / 2 if high > low else low + 0.5  # mixed picks, or all S2
        beta_o = B * S * layout.tensor / (theta * layout.expert_shard)
        path = str(tmp_path / f"profile_{index}.yaml")
        save_profile(HardwareProfile(f"threshold_{index}", AlphaBeta(0.0, 1.0), AlphaBeta(0.0, 0.0),
                                     AlphaBeta(0.0, beta_o)), path)
        picks = ["s1" if layout.tensor == 1 or load >= (theta if saa else B * S) else "s2" for load in loads]
        out[index] = (path, picks)
    return out


def _run_layout(state, profiles, check_comm):
    results = []
    for schedule, saa, index in RUNS:
        cfg, full, xs, gs = case_data(index, state.dp_size)
        cfg.moe.schedule, cfg.moe.saa = schedule, saa
        if schedule == "auto":
            cfg.perf.hardware_profile = profiles[index][0]
        results.append(run_layer(state, cfg, full, xs, gs))
    comm = []
    for schedule, saa in COMM_RUNS if check_comm else []:
        cfg = case_config(0)
        cfg.moe.schedule, cfg.moe.saa = schedule, saa
        comm.append(balanced_layer_comm(state, cfg))
    return results, comm


def _run_layouts(state, jobs):
    """Every (layout, profiles, check_comm) job on this spawn's processes: process start-up, not
    the layer, dominates a spawn on 2 cores, so each world size is spawned once."""
    return [_run_layout(ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank),
                        profiles, check_comm) for kwargs, profiles, check_comm in jobs]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """world -> [(profiles, outputs per rank)] in LAYOUTS order, spawned on first use."""
    cache = {}

    def get(world):
        if world not in cache:
            layouts = [(kw, check) for w, kw, check in LAYOUTS if w == world]
            jobs = [(kw, _threshold_profiles(RankLayout(world_size=world, **kw), tmp_path_factory.mktemp("profiles")),
                     check) for kw, check in layouts]
            outputs = run_distributed(world, _run_layouts, layouts[0][0], args=(jobs,), timeout=600)
            cache[world] = {str(kw): (profiles, [out[i] for out in outputs])
                            for i, (kw, profiles, _) in enumerate(jobs)}
        return cache[world]

    return get


def _expected_volumes(schedule: str, saa: bool, layout: RankLayout):
    """Per-rank bytes (fp32 values, int64 counts) of one forward and one backward with balanced
    routing: n = B S tokens of M = H, k = 2, r = n k / N_MP assignments per TP rank, each dumped to
    N_ESP shard holders. Both EP&ESP-AlltoAlls carry 4 r N_ESP H bytes = A2A(ETM N_ESP / N_MP)
    (Eq. 7, 11), 1/N_MP of the baseline's EP-AlltoAll (Eq. 1: ETM N_ESP); no ESP collective."""
    tp, ep, esp, k, n = layout.tensor, layout.expert, layout.expert_shard, 2, B * S
    r, sources = n * k // tp, ep * esp
    baseline_a2a = 4 * (E * (k * n // E) * H) * esp  # Eq. 1: A2A_EP(ETM x N_ESP), T = k B L / E
    a2a = baseline_a2a // tp
    fwd = {"all_gather_counts/ep_esp": 8 * E * sources, "all_to_all/ep_esp": 2 * a2a}
    bwd = {"all_to_all/ep_esp": 2 * a2a}
    if schedule == "s1":  # tp counts + aux sums; MP-AllGather(BLM); router f; MP-Split's all-gather
        fwd.update({"all_gather_counts/tp": 8 * E * tp, "all_reduce/tp": 4 * (E + 1), "all_gather/tp": 4 * n * H})
        bwd.update({"all_reduce/tp": 4 * E * H, "all_gather/tp": 4 * n * H})
    else:  # MP-AllGather(ETM) of the expert outputs; in backward of the MP-Split after the gate
        fwd["all_gather/tp"] = bwd["all_gather/tp"] = 4 * n * k * H
    if saa:  # second exchange phased: own slice (r / N_EP rows to this EP rank) stays local
        for d in (fwd, bwd):
            d["all_to_all/ep_esp"] = a2a
            d["all_to_all_p2p/ep_esp"] = 4 * (r * esp - r // ep) * H
        fwd["all_gather_routing/tp"] = 8 * tp * (ep + r)  # peers' rows per EP rank + send orders
    return [{key: v for key, v in d.items() if key.split("/")[1] != "tp" or tp > 1} for d in (fwd, bwd)]


@pytest.mark.distributed
@pytest.mark.parametrize("world,layout_kwargs,check_comm", LAYOUTS, ids=[
    "-".join(f"{short}{kw[key]}" for key, short in (("tensor", "tp"), ("expert", "ep"), ("expert_shard", "esp"))
             if key in kw) for _, kw, _ in LAYOUTS])
def test_parm_schedules_equal_reference(world, layout_kwargs, check_comm, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    profiles, outputs = spawned(world)[str(layout_kwargs)]
    for i, (schedule, saa, index) in enumerate(RUNS):
        label = f"{schedule} saa={saa}"
        refs = check_against_reference([out[0][i] for out in outputs], index, layout, label)
        stats = [out[0][i]["stats"] for out in outputs]
        for rank, s in enumerate(stats):
            d = layout.coords(rank)["dp"]
            expected = profiles[index][1][d] if schedule == "auto" else schedule
            assert s.schedule == expected, (label, rank)
            group = layout.group_of("ep_esp", rank)
            assert torch.equal(s.tokens_per_ep_rank, stats[group[0]].tokens_per_ep_rank), (label, rank)
        # no token computed twice: the ep_esp groups together compute every kept assignment once
        computed = sum(stats[g[0]].tokens_per_ep_rank for g in layout.groups("ep_esp"))
        kept = torch.tensor([ref.kept_per_expert for ref in refs]).sum(0).view(layout.expert, -1).sum(1)
        assert computed.tolist() == kept.tolist(), label
    picks = {s.schedule for out in outputs for (schedule, _, _), s in
             zip(RUNS, (r["stats"] for r in out[0])) if schedule == "auto"}
    if layout.tensor > 1:
        assert picks == {"s1", "s2"}, picks  # Alg. 1 picked both across the micro-batches
    for rank, out in enumerate(outputs):
        for (schedule, saa), (forward, backward) in zip(COMM_RUNS, out[1]):
            fwd, bwd = _expected_volumes(schedule, saa, layout)
            assert forward == fwd, (schedule, saa, rank)
            assert backward == bwd, (schedule, saa, rank)
            assert not any(key.endswith(("/esp", "/ep")) for key in {**forward, **backward})

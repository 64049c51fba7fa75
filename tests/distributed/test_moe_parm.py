"""Parm S1, S2 (AAS and SAA) and auto == single-process reference; Parm's communication volumes.

One spawn per world size runs, for each of its layouts, every schedule on the cases of
`moe_cases` (dropless and capacity 1.0 with drops); each layout's test checks outputs, aux loss,
input and ALL parameter gradients, routing statistics and the computed load.

`auto` runs twice more per layout on patterned routing (`moe_cases.patterned_tokens`) with a
profile whose every alpha and beta is non-zero and whose Alg. 1 threshold lies between the two
patterns' E T: balanced routing (E T = k B S) must pick S2 and skewed routing (every token on
experts 0 and 1, E T >= 2 k B S) S1, each exact; under S1 no SAA point-to-point traffic may run
(SAA is S2's combine), under S2 it must. Every auto pick must be identical on all ranks that
share a TP or an `ep_esp` group. The volume check replays perfectly balanced routing and
compares every counter with Parm's analysis.
"""
from pathlib import Path

import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.hardware import HardwareProfile, save_profile
from tests.distributed.harness import BACKENDS, run_distributed
from tests.distributed.moe_cases import (B, E, H, ROUTER_EYE, S, balanced_layer_comm, case_config, case_data,
                                         check_against_reference, check_results, patterned_tokens, reference_of,
                                         run_layer)
from tests.moe_reference import random_full_weights

TESTBED_B = str(Path(__file__).resolve().parents[2] / "configs/hardware/parm_testbed_b.yaml")
RUNS = [  # (moe.schedule, moe.saa, case index): each schedule dropless and with capacity drops
    ("s1", False, 0), ("s1", False, 1), ("s1", False, 2),
    ("s2", False, 0), ("s2", False, 2),
    ("s2", True, 1), ("s2", True, 3),
    ("auto", True, 0), ("auto", True, 1), ("auto", False, 2), ("auto", False, 3),
    ("s1", False, 4), ("s2", True, 5), ("auto", True, 4),  # router variants + shared experts (moe_cases.VARIANTS)
]
PATTERNS = [("balanced", "s2"), ("skewed", "s1")]  # auto's routing pattern -> Alg. 1's pick
COMM_RUNS = [("s1", False), ("s2", False), ("s2", True)]
LAYOUTS = [  # (world, layout, check volumes)
    (8, dict(tensor=2, expert=2, expert_shard=2), True),
    (4, dict(tensor=2, expert=2), False),
    (8, dict(tensor=2, expert=4), False),
    (8, dict(tensor=4, expert=2), True),  # a TP group spans two ep_esp groups
    (4, dict(expert=2, expert_shard=2), True),
    (8, dict(tensor=2, expert=2, expert_shard=4), False),  # each ESP group spans two TP groups
    (8, dict(tensor=4, expert=2, expert_shard=2), False),  # each ESP group inside a TP group
]


def _switch_profile(layout: RankLayout, path: str) -> str:
    """A profile with every term non-zero whose Alg. 1 (SAA) picks S1 iff E T >= theta =
    1.5 k B S, between the balanced (k B S) and skewed (>= 2 k B S) patterns. With
    alpha_o = alpha_A2A + alpha_AG the alphas cancel in t_D1 - t_D2 (Eq. 13 - Eq. 14), leaving
    beta_AG B S M - (beta_o - beta_A2A) x with x = E T M N_ESP / N_MP; beta_o is set so that
    this is zero at E T = theta."""
    theta = 1.5 * 2 * B * S
    a2a, ag = AlphaBeta(2e-4, 1e-9), AlphaBeta(1e-4, 3e-9)
    beta_o = a2a.beta + ag.beta * B * S * layout.tensor / (theta * layout.expert_shard)
    save_profile(HardwareProfile("switch", ag, a2a, AlphaBeta(a2a.alpha + ag.alpha, beta_o)), path)
    return path


def _run_layout(state, switch_profile, check_comm):
    results = []
    for schedule, saa, index in RUNS:
        cfg, full, xs, gs = case_data(index, state.dp_size)
        cfg.moe.schedule, cfg.moe.saa, cfg.perf.hardware_profile = schedule, saa, TESTBED_B
        results.append(run_layer(state, cfg, full, xs, gs))
    switched = []
    for pattern, _ in PATTERNS:
        cfg, full, xs, gs = _pattern_case(pattern, state.dp_size)
        cfg.perf.hardware_profile = switch_profile
        C.COMM_STATS.reset()
        switched.append((run_layer(state, cfg, full, xs, gs), C.COMM_STATS.snapshot()))
    comm = []
    for schedule, saa in COMM_RUNS if check_comm else []:
        cfg = case_config(0)
        cfg.moe.schedule, cfg.moe.saa = schedule, saa
        comm.append(balanced_layer_comm(state, cfg))
    return results, switched, comm


def _pattern_case(pattern: str, dp: int):
    """auto + SAA, dropless top-2, on `patterned_tokens(pattern)` in every micro-batch."""
    cfg = case_config(0)
    cfg.moe.schedule, cfg.moe.saa = "auto", True
    full = random_full_weights(cfg, seed=11)
    full["router.weight"] = ROUTER_EYE.clone()
    gs = torch.randn(dp, B, S, H, generator=torch.Generator().manual_seed(12))
    return cfg, full, patterned_tokens(pattern).expand(dp, B, S, H).clone(), gs


def _run_layouts(state, jobs):
    """Every (layout, profile, check_comm) job on this spawn's processes: process start-up, not
    the layer, dominates a spawn on 2 cores, so each world size is spawned once."""
    return [_run_layout(ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank),
                        profile, check_comm) for kwargs, profile, check_comm in jobs]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """(world, backend) -> {layout: outputs per rank}, spawned on first use."""
    cache = {}

    def get(world, backend="gloo"):
        if (world, backend) not in cache:
            tmp = tmp_path_factory.mktemp("profiles")
            jobs = [(kw, _switch_profile(RankLayout(world_size=world, **kw), str(tmp / f"switch_{i}.yaml")), check)
                    for i, (w, kw, check) in enumerate(LAYOUTS) if w == world]
            outputs = run_distributed(world, _run_layouts, jobs[0][0], args=(jobs,), timeout=600, backend=backend)
            cache[(world, backend)] = {str(kw): [out[i] for out in outputs] for i, (kw, _, _) in enumerate(jobs)}
        return cache[(world, backend)]

    return get


def _agreeing_blocks(layout: RankLayout):
    """Ranks that must run the same auto pick: unions of overlapping tp and ep_esp groups."""
    blocks = []
    for group in layout.groups("tp") + layout.groups("ep_esp"):
        merged = set(group)
        for block in [b for b in blocks if b & merged]:
            merged |= block
            blocks.remove(block)
        blocks.append(merged)
    return blocks


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
        if (ep * esp) % tp:  # a TP group spans ep_esp groups: peers' rows per EP rank + send orders
            fwd["all_gather_routing/tp"] = 8 * tp * (ep + r)
    return [{key: v for key, v in d.items() if key.split("/")[1] != "tp" or tp > 1} for d in (fwd, bwd)]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs,check_comm", LAYOUTS, ids=[
    "-".join(f"{short}{kw[key]}" for key, short in (("tensor", "tp"), ("expert", "ep"), ("expert_shard", "esp"))
             if key in kw) for _, kw, _ in LAYOUTS])
def test_parm_schedules_equal_reference(world, layout_kwargs, check_comm, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    for i, (schedule, saa, index) in enumerate(RUNS):
        label = f"{schedule} saa={saa}"
        refs = check_against_reference([out[0][i] for out in outputs], index, layout, label)
        stats = [out[0][i]["stats"] for out in outputs]
        for rank, s in enumerate(stats):
            assert s.schedule in (("s1", "s2") if schedule == "auto" else (schedule,)), (label, rank)
            group = layout.group_of("ep_esp", rank)
            assert torch.equal(s.tokens_per_ep_rank, stats[group[0]].tokens_per_ep_rank), (label, rank)
        for block in _agreeing_blocks(layout):
            assert len({stats[r].schedule for r in block}) == 1, (label, sorted(block))
        # no token computed twice: the ep_esp groups together compute every kept assignment once
        computed = sum(stats[g[0]].tokens_per_ep_rank for g in layout.groups("ep_esp"))
        kept = torch.tensor([ref.kept_per_expert for ref in refs]).sum(0).view(layout.expert, -1).sum(1)
        assert computed.tolist() == kept.tolist(), label
    for j, (pattern, expected) in enumerate(PATTERNS):
        results = [out[1][j][0] for out in outputs]
        check_results(results, reference_of(*_pattern_case(pattern, layout.data_parallel)), layout, f"auto {pattern}")
        for rank, out in enumerate(outputs):
            assert results[rank]["stats"].schedule == (expected if layout.tensor > 1 else "s1"), (pattern, rank)
            p2p = {key for key in out[1][j][1] if key.startswith("all_to_all_p2p")}
            # SAA is S2's combine: phased point-to-point under S2 (with a peer), never under S1
            assert bool(p2p) == (results[rank]["stats"].schedule == "s2" and layout.expert > 1), (pattern, rank, p2p)
    for rank, out in enumerate(outputs):
        for (schedule, saa), (forward, backward) in zip(COMM_RUNS, out[2]):
            fwd, bwd = _expected_volumes(schedule, saa, layout)
            assert forward == fwd, (schedule, saa, rank)
            assert backward == bwd, (schedule, saa, rank)
            assert not any(key.endswith(("/esp", "/ep")) for key in {**forward, **backward})

"""Per-iteration replicas (moe/replicas.py: Trans / Agg) under every schedule == the single-process
reference, and their bytes equal the formula.

Two fixed policies: `ShadowFixed` shadows experts 0 and E-1 (FasterMoE's placement,
`Placement.shadowed`: every EP rank holds a replica, each source computes its own rows of them
locally; Trans by broadcast, Agg by reduce); `ReplicateOne` gives expert 0 one replica on the last
EP rank and splits every source's rows of it between owner and replica (Pro-Prophet-style; point
to point). Each layout runs every schedule on the dropless and capacity cases of `moe_cases`;
outputs, aux loss, input and all parameter gradients must equal the reference, and the Trans /
Agg bytes of each rank must be (for `moe.balancer` fastermoe and proprophet, whose choices depend
on the counts: summed over each EP group, replicas x shard parameters x 4 bytes each way)
  trans: sum over replicated experts it owns of (replicas) x shard parameters x 4 bytes
  agg:   (replicas it holds) x shard parameters x 4 bytes
all of it on `ep`'s side channel (group "ep_side", built as `SIDE_CHANNELS` asks: issue #44),
none on `ep`; the calls there per rank (fixed policies): a broadcast (Trans) and a reduce (Agg)
per parameter tensor of every expert replicated on every EP rank, and one point-to-point batch
each way on the ranks that own or hold another replica.
"""
from dataclasses import replace

import pytest

from megatron_moe.config.validate import expert_proj_bias
from megatron_moe.distributed.parallel_state import RankLayout
from megatron_moe.moe.balancers.base import Balancer
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.replicas import AGG_KIND, TRANS_KIND
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.hardware import load_profile, save_profile
from tests.distributed.harness import BACKENDS, per_world_spawner
from tests.distributed.moe_cases import E, FFN, H, case_config, check_against_reference, run_on_layouts
from tests.distributed.test_moe_parm import TESTBED_B

SHADOWED = (0, E - 1)
RUNS = [  # (schedule, saa, case): dropless and capacity with drops; gelu + bias and swiglu
    ("baseline", False, 0), ("baseline", False, 1),
    ("s1", False, 2), ("s2", False, 0), ("s2", True, 1), ("auto", True, 3),
    ("s2", True, 4), ("baseline", False, 5),  # router variants + shared experts (moe_cases.VARIANTS)
    ("s1", False, 6),  # gpt-oss: router bias, expert biases without model.bias, swiglu_oss
]
LAYOUTS = [(2, dict(expert=2)), (4, dict(expert=4)), (8, dict(tensor=2, expert=2, expert_shard=2))]


class ShadowFixed(Balancer):
    """Test policy: shadow `SHADOWED` in every forward."""

    def plan(self, counts, source_ep_ranks):
        return Placement.shadowed(counts, self.ep_size, SHADOWED, source_ep_ranks)


class ReplicateOne(Balancer):
    """Test policy: expert 0 also on the last EP rank; every source sends it the second half of its rows."""

    def plan(self, counts, source_ep_ranks):
        owner_only = Placement.owner_only(counts, self.ep_size)
        table, last = owner_only.routing_table.clone(), self.ep_size - 1
        table[:, 0, last] = counts[:, 0] - counts[:, 0] // 2
        table[:, 0, 0] = counts[:, 0] // 2
        return Placement(((0, last),) + owner_only.replicas[1:], table)


POLICIES = {"shadow": (ShadowFixed, {e: "all" for e in SHADOWED}), "one": (ReplicateOne, {0: "last"}),
            "fastermoe": (None, None),  # moe.balancer=fastermoe, min_shadow 1: the most popular expert
            "proprophet": (None, None)}  # moe.balancer=proprophet, min_replicas 1; overlap on every other run


def _fastermoe_profile(path: str) -> str:
    """Testbed B's Parm costs (for auto) and a broadcast so slow that Alg. 1 shadows only what
    min_shadow forces."""
    save_profile(replace(load_profile(TESTBED_B), p2p=AlphaBeta(0, 1e-9), broadcast=AlphaBeta(0, 1.0),
                         expert_compute=AlphaBeta(0, 1e-12)), path)
    return path


def _run(state, jobs, profile):
    def setup(run):
        policy, (schedule, saa, index) = run

        def edit(cfg, sub):
            cfg.moe.schedule, cfg.moe.saa, cfg.perf.hardware_profile = schedule, saa, TESTBED_B
            balancer = POLICIES[policy][0]
            if policy == "fastermoe":
                cfg.moe.balancer, cfg.moe.fastermoe.min_shadow, cfg.perf.hardware_profile = "fastermoe", 1, profile
            if policy == "proprophet":
                cfg.moe.balancer, cfg.moe.proprophet.min_replicas, cfg.perf.hardware_profile = "proprophet", 1, profile
                cfg.moe.proprophet.overlap = RUNS.index((schedule, saa, index)) % 2 == 1
            return balancer(cfg, sub) if balancer else None

        return index, edit

    return run_on_layouts(state, jobs, [(p, run) for p in POLICIES for run in RUNS], setup, side_channels=["ep"])


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    profile = _fastermoe_profile(str(tmp_path_factory.mktemp("profile") / "fastermoe.yaml"))
    return per_world_spawner(LAYOUTS, _run, args=(profile,))


def _shard_params(index: int, layout: RankLayout) -> int:
    """Elements of one expert's parameters on one ESP shard: w1 [h, (2,) f'], w2 [f', h],
    b1 [(2,) f'] and b2 [h / esp] with biases; f' = FFN / esp."""
    cfg = case_config(index)
    activation, bias = cfg.moe.activation or cfg.model.activation, expert_proj_bias(cfg)
    units = FFN // layout.expert_shard
    gates = 2 if activation in ("swiglu", "swiglu_oss") else 1
    return H * gates * units + units * H + (gates * units + H // layout.expert_shard if bias else 0)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "ep4", "tp2-ep2-esp2"])
def test_replicas_equal_reference_with_formula_bytes(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    for i, (policy, (schedule, saa, index)) in enumerate([(p, run) for p in POLICIES for run in RUNS]):
        label = f"{policy} {schedule} saa={saa}"
        check_against_reference([out[i][0] for out in outputs], index, layout, label)
        elements, replicated = _shard_params(index, layout), POLICIES[policy][1]
        for rank, out in enumerate(outputs):  # Trans / Agg on the side channel only: no byte, no call on ep
            on_ep = {key for counter in (out[i][1], out[i][0]["calls"]) for key in counter
                     if key in (f"{TRANS_KIND}/ep", f"{AGG_KIND}/ep")}
            assert not on_ep, (label, rank, on_ep)
        if replicated is None:  # fastermoe / proprophet: bytes = replicas x shard parameters, whichever they are
            for group in layout.groups("ep"):
                stats = [outputs[r][i][0]["stats"] for r in group]
                replicas = stats[0].replicas
                assert replicas >= 1 and all(s.replicas == replicas for s in stats), label
                if policy == "fastermoe":  # exactly one shadow: the most popular expert on every other EP rank
                    assert replicas == layout.expert - 1, label
                for kind in (TRANS_KIND, AGG_KIND):
                    assert sum(outputs[r][i][1].get(f"{kind}/ep_side", 0) for r in group) == replicas * elements * 4, \
                        (label, kind)
            continue
        holders = {e: range(layout.expert) if where == "all" else [layout.expert - 1] for e, where in replicated.items()}
        for rank, out in enumerate(outputs):
            ep_rank, nbytes = layout.coords(rank)["ep"], out[i][1]
            owner = {e: e // (E // layout.expert) for e in replicated}
            sent = sum(len([q for q in holders[e] if q != owner[e]]) for e in replicated if owner[e] == ep_rank)
            held = sum(1 for e in replicated if ep_rank in holders[e] and owner[e] != ep_rank)
            assert nbytes.get("trans/ep_side", 0) == sent * elements * 4, (label, rank, nbytes)
            assert nbytes.get("agg/ep_side", 0) == held * elements * 4, (label, rank, nbytes)
            members = {e: {owner[e], *holders[e]} for e in replicated}
            everywhere = sum(1 for e in replicated if len(members[e]) == layout.expert)  # broadcast / reduce
            pairs = any(len(members[e]) < layout.expert and ep_rank in members[e] for e in replicated)
            calls = everywhere * (4 if expert_proj_bias(case_config(index)) else 2) + pairs  # w1, w2 (b1, b2); p2p
            assert {k: out[i][0]["calls"].get(f"{k}/ep_side", 0) for k in (TRANS_KIND, AGG_KIND)} == \
                {TRANS_KIND: calls, AGG_KIND: calls}, (label, rank, out[i][0]["calls"])
            assert out[i][0]["stats"].replicas == sum(len([q for q in holders[e] if q != owner[e]])
                                                      for e in replicated), label

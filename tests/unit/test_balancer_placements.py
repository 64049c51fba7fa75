"""The placements the balancers reach on a fixed recorded routing trace (issue #42 item 10).

Every balancer is exact, so the end-to-end runs (`tests/e2e/test_balancers.py`,
`tests/e2e/test_vexperts.py`) give the same losses whatever placement a planner picks: they
cannot tell a planner that balances from one that leaves the owners' placement. Here each planner
replays `tests/data/routing_trace_tiny_ep4.json`, a trace recorded by a real run (its
`recorded_by`: the tiny GPT-MoE, 8 experts on expert=4, 10 iterations of 2 micro-batches per
rank), written back through `RoutingTraceWriter` and driven the way training drives it: the
cluster simulator calls the balancers' own `plan` / `observe` / `decide` (`sim/runner.py`) on a
fixed profile (PROFILE), with every option that picks the placement pinned. Per balancer:

* the placement it reaches: the experts replicated in the last two forwards of MoE layer 1
  (FasterMoE, Pro-Prophet) or both layers' final slot tables (FlexMoE, EPLB);
* the rows each EP rank computes in the last iteration, recomputed by hand from the trace where
  the placement fixes them (FasterMoE's shadows and Pro-Prophet's `rows: local`: each replica
  computes its own sources' rows; `rows: balanced`: 512 / 4 on every rank);
* the balance: layer 1's max / mean rows per EP rank averaged over the 10 iterations equals
  `BALANCE` and is at least 15% below the owners' placement's (none: 1.956, by hand from the
  trace). A planner that returns the owners' placement (or anything as unbalanced) fails here.

The trace is early training: layer 1's hot experts change within a few iterations (expert 4 goes
from 0 to 246 of 512 rows), so a plan made on the last window pays for it (EPLB at iteration 7:
2.87, none 1.93). The exact values are the planners' as of this test; a planner change that moves
them updates them here (the assertion messages print the new ones), the 15% is the claim.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_moe.config import load_config
from megatron_moe.moe.routing_trace import RoutingTraceWriter
from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.runner import Simulation

TRACE = Path(__file__).resolve().parents[1] / "data" / "routing_trace_tiny_ep4.json"
# tools/profile_comm.py's fit on 2 CPU ranks (configs/hardware/cpu_gloo_2proc.yaml), rounded and
# kept here so that a re-fit of that file cannot move the placements
PROFILE = """name: placements
mp_allgather: {alpha: 0.0, beta: 0.0}
ep_esp_alltoall: {alpha: 5.0e-4, beta: 2.0e-9}
saa: {alpha: 1.3e-4, beta: 1.1e-8}
p2p: {alpha: 3.7e-4, beta: 2.7e-9}
broadcast: {alpha: 2.8e-4, beta: 1.8e-9}
expert_compute: {alpha: 6.5e-4, beta: 3.2e-11}
"""
# the recording run's layout and batch: 4 data-parallel sources of 2 micro-batches of 32 tokens
BASE = ["training.micro_batch_size=1", "training.global_batch_size=8", "model.seq_length=32",
        "moe.capacity_factor=null", "parallel.expert=4"]
# each balancer with every option that picks its placement pinned (defaults may move)
OPTIONS = {
    "none": ["moe.balancer=none"],
    "fastermoe": ["moe.balancer=fastermoe", "moe.fastermoe.eq8=printed", "moe.fastermoe.min_shadow=0"],
    "flexmoe": ["moe.balancer=flexmoe", "moe.flexmoe.policy=straggler", "moe.flexmoe.trigger=threshold",
                "moe.flexmoe.threshold=1.1", "moe.flexmoe.amortize_steps=100", "moe.flexmoe.slots_per_rank=3",
                "moe.flexmoe.moves=sync"],
    "eplb": ["moe.balancer=eplb", "moe.eplb.interval=1", "moe.eplb.ema=0.5", "moe.eplb.redundant_slots=4",
             "moe.eplb.hierarchical=false"],
    "proprophet": ["moe.balancer=proprophet", "moe.proprophet.rows=balanced", "moe.proprophet.alpha=0.5",
                   "moe.proprophet.plan_interval=1", "moe.proprophet.bottom_k=0", "moe.proprophet.min_replicas=0"],
    "proprophet-local": ["moe.balancer=proprophet", "moe.proprophet.rows=local", "moe.proprophet.alpha=0.5",
                         "moe.proprophet.plan_interval=1", "moe.proprophet.bottom_k=0",
                         "moe.proprophet.min_replicas=0"],
}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """The recorded trace as a `logging.routing_trace` directory, and its counts [I, L, S, M, E]."""
    recorded = json.loads(TRACE.read_text())
    micro = np.array(recorded["micro_counts"], dtype=np.int64)
    directory = tmp_path_factory.mktemp("trace") / "routing"
    writer = RoutingTraceWriter(str(directory), recorded["header"])
    for iteration, counts in zip(recorded["iterations"], micro):
        writer.append(iteration, counts.sum(2), np.zeros(counts.shape[:2]), counts)
    writer.close()
    return str(directory), micro


def replay(name, trace, workdir):
    """-> (rows [I, L, ep] computed per EP rank, replicated {expert: EP ranks} of every forward of
    layer 1, final slot tables per layer or None)."""
    directory, micro = trace
    workdir.mkdir()
    (workdir / "profile.yaml").write_text(PROFILE)
    cfg = load_config("configs/gpt_moe_tiny.yaml", BASE + OPTIONS[name])
    sim = Simulation(cfg, load_profile(str(workdir / "profile.yaml")), 4, str(workdir))
    planner, forwards = sim.planners[1][0], []

    def plan(counts, sources, plan=planner.plan):
        placement = plan(counts, sources)
        forwards.append({e: ranks for e, ranks in enumerate(placement.replicas) if len(ranks) > 1})
        return placement

    planner.plan = plan
    results = sim.run(sim.trace(directory, len(micro)).steps())
    assert [r.iteration for r in results] == list(range(1, len(micro) + 1))
    rows = np.array([[layer.rows_per_ep_rank for layer in r.layers] for r in results]).astype(np.int64)
    assert (rows.sum(-1) == micro.sum((2, 3, 4))).all()  # every assignment computed once, none dropped
    slots = [layer[0].table.slots.tolist() for layer in sim.planners] if sim.vexperts else None
    return rows, forwards, slots


def balance(rows):
    """[I, L, ep] -> [I, L]: max / mean rows per EP rank."""
    return rows.max(-1) / rows.mean(-1)


def owner_rows(T):
    """T [S, E] rows of one forward (source s on EP rank s) -> [ep] rows per EP rank, owners only."""
    return T.reshape(T.shape[0], T.shape[0], -1).sum((0, 2))


def local_rows(T, replicated):
    """The same with `replicated` {expert: EP ranks}: a rank listed computes its own sources' rows
    of the expert, the owner (listed first) the rows of the ranks not listed (FasterMoE's shadows
    on every rank, Pro-Prophet's `rows: local`)."""
    rows = owner_rows(T)
    per_rank = T.shape[1] // T.shape[0]
    for e, ranks in replicated.items():
        owner, others = e // per_rank, list(ranks[1:])
        assert ranks[0] == owner
        rows[owner] -= T[others, e].sum()
        rows[others] += T[others, e]
    return rows


# layer 1's max / mean rows per EP rank, mean over the 10 iterations (none: 1.9562); each <= 0.85 x none's
BALANCE = {"fastermoe": 1.5141, "flexmoe": 1.6070, "eplb": 1.6047, "proprophet": 1.2797, "proprophet-local": 1.5055}
LAST_ROWS = {  # [layer][EP rank] rows computed in iteration 10
    "none": [[101, 156, 127, 128], [0, 197, 291, 24]],
    "fastermoe": [[101, 156, 127, 128], [87, 150, 146, 129]],
    "flexmoe": [[109, 124, 150, 129], [124, 125, 122, 141]],
    "eplb": [[153, 122, 121, 116], [131, 131, 105, 145]],
    "proprophet": [[101, 156, 127, 128], [128, 128, 128, 128]],
    "proprophet-local": [[101, 156, 127, 128], [103, 159, 116, 134]],
}
EVERYWHERE = {2: (1, 0, 2, 3), 4: (2, 0, 1, 3)}  # the two hot experts of layer 1, on every EP rank
LAST_REPLICATED = {  # layer 1's last two forwards (iteration 10's micro-batches): {expert: EP ranks}
    "fastermoe": [EVERYWHERE, EVERYWHERE],
    "proprophet": [EVERYWHERE, EVERYWHERE],
    "proprophet-local": [{**EVERYWHERE, 5: (2, 0, 1)}, {**EVERYWHERE, 5: (2, 0, 1, 3)}],
}
SLOTS = {  # final [layer][EP rank][slot] expert (-1: empty)
    "flexmoe": [[[4, 2, -1], [6, 5, 5], [3, 1, 5], [0, 7, 7]], [[4, 6, 1], [7, 5, 3], [0, 4, -1], [2, 2, 2]]],
    "eplb": [[[4, 7, 2], [1, 6, 2], [0, 5, 3], [0, 5, 3]], [[2, 1, 4], [2, 6, 4], [0, 4, 7], [5, 2, 3]]],
}


@pytest.fixture(scope="module")
def none(trace, tmp_path_factory):
    return replay("none", trace, tmp_path_factory.mktemp("none") / "sim")


def test_owners_placement_is_the_trace_summed_by_owner(trace, none):
    """The baseline the balancers are measured against, by hand from the trace."""
    _, micro = trace
    rows, _, slots = none
    assert slots is None
    expected = np.array([[owner_rows(micro[i, layer].sum(1)) for layer in range(2)] for i in range(len(micro))])
    np.testing.assert_array_equal(rows, expected)
    assert rows[-1].tolist() == LAST_ROWS["none"]
    assert balance(rows)[:, 1].mean() == pytest.approx(1.9562, abs=1e-4)


@pytest.mark.parametrize("name", list(BALANCE))
def test_balancer_reaches_its_placement_and_beats_the_owners(name, trace, none, tmp_path):
    _, micro = trace
    rows, forwards, slots = replay(name, trace, tmp_path / "sim")
    owners = balance(none[0])[:, 1]
    ratios = balance(rows)[:, 1]  # [I] layer 1
    assert ratios.mean() <= 0.85 * owners.mean(), (ratios, owners)
    assert ratios.mean() == pytest.approx(BALANCE[name], abs=1e-4), ratios.mean()
    assert rows[-1].tolist() == LAST_ROWS[name], rows[-1].tolist()
    assert slots == SLOTS.get(name), slots
    if name in LAST_REPLICATED:
        assert forwards[-2:] == LAST_REPLICATED[name], forwards[-2:]
    if name != "proprophet" and name in LAST_REPLICATED:  # every replica computes its own sources' rows
        by_hand = sum(local_rows(micro[-1, 1, :, m], forwards[-2 + m]) for m in range(2))
        assert by_hand.tolist() == rows[-1, 1].tolist()
    if name == "proprophet":  # rows balanced: the replicas' rows water-filled, every rank 512 / 4
        assert rows[-1, 1].tolist() == [micro[-1, 1].sum() // 4] * 4
    if name == "eplb":  # the 4 redundant slots of layer 1 went to its two hot experts, 3 copies each
        held = np.array(slots[1])
        assert (held == 2).sum() == (held == 4).sum() == 3 and len(np.unique(held)) == 8

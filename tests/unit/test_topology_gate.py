"""FasterMoE's topology-aware gate (§4.3, techniques/fastermoe/topology_gate.py) against the plain-loop reference."""
import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.moe.router import GATES
from megatron_moe.techniques.fastermoe.topology_gate import topology_select
from tests.moe_reference import topology_choices


def test_budget_keeps_the_best_remote_choices_and_reselects_locally():
    probs = torch.tensor([[0.50, 0.30, 0.15, 0.05],    # experts 2, 3 are on another node
                          [0.05, 0.15, 0.30, 0.50],
                          [0.10, 0.20, 0.60, 0.10]])
    remote = torch.tensor([False, False, True, True])
    ids, weights = topology_select(probs, 2, remote, budget=1)
    # remote choices: t1 (3: .50, 2: .30), t2 (2: .60); budget 1 keeps t2's expert 2; t1 re-selects
    # its best local experts 1 (.15) and 0 (.05)
    assert ids.tolist() == [[0, 1], [1, 0], [2, 1]]
    torch.testing.assert_close(weights[1], torch.tensor([0.75, 0.25]))
    assert topology_select(probs, 2, remote, budget=3)[0].tolist() == [[0, 1], [3, 2], [2, 1]]  # all fit
    ids, weights = topology_select(probs, 1, remote, budget=0)  # Switch: the raw probability
    assert ids.tolist() == [[0], [1], [1]]
    torch.testing.assert_close(weights[:, 0], torch.tensor([0.5, 0.15, 0.2]))
    # a node with fewer local experts than the token needs: its first demoted choice (3) takes the
    # only local expert 0, the second (2) finds none left and stays
    assert topology_select(probs, 2, torch.tensor([False, True, True, True]), budget=0)[0].tolist()[1] == [2, 0]


def test_matches_the_loop_reference_on_random_routing():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        n, num_experts, k = 16, 8, 1 + trial % 2
        probs = torch.softmax(torch.randn(n, num_experts, generator=gen) * 2, -1)
        remote = torch.rand(num_experts, generator=gen) < 0.5
        budget = int(torch.randint(0, n * k, (1,), generator=gen))
        ids, _ = topology_select(probs, k, remote, budget)
        assert ids.tolist() == topology_choices(list(probs), k, remote.tolist(), budget), trial
        if int((~remote).sum()) >= 2 * k:  # enough local experts to re-select: the budget holds
            assert int(remote[ids].sum()) <= budget, trial


def test_gate_sees_nodes_from_its_micro_batch():
    """ep 4 on 2 nodes of 2 ranks: rank 1's experts 4-7 are off its node; its budget is ratio/M n k."""
    cfg = Config()
    cfg.moe.num_experts, cfg.moe.gate, cfg.moe.topology_gate.bandwidth_ratio = 8, "topology", 0.5
    state = ParallelState.build(RankLayout(world_size=4, expert=4, ranks_per_node=2), rank=1)
    gate = GATES.get("topology")(cfg, state)
    assert gate.remote.tolist() == [False] * 4 + [True] * 4 and gate.fraction == 0.25

"""Collectives: values, autograd and byte accounting on 4 gloo processes."""
import torch

from megatron_moe.distributed import collectives as C
from tests.distributed.harness import run_distributed


def _check_collectives(state):
    ep, r = state.ep_esp, state.ep_esp.rank  # 4 ranks: expert=2 expert_shard=2
    C.COMM_STATS.reset()
    # all_reduce / all_gather / reduce_scatter
    x = torch.full((2, 3), float(r + 1))
    assert torch.equal(C.all_reduce(x.clone(), ep), torch.full((2, 3), 10.0))
    g = C.all_gather(x, ep)
    assert g.shape == (8, 3) and g[2 * r, 0] == r + 1
    rs = C.reduce_scatter(torch.arange(8.0).repeat(1, 1).reshape(8, 1) * (r + 1), ep)
    assert torch.equal(rs.flatten(), torch.tensor([2 * r, 2 * r + 1]) * 10.0)
    # all_to_all_v with uneven splits: rank r sends (r + i) rows to rank i, values 100 r + i
    send = [r + i for i in range(4)]
    recv = [i + r for i in range(4)]
    t = torch.cat([torch.full((n, 2), 100.0 * r + i) for i, n in enumerate(send)])
    out = C.all_to_all_v(t, send, recv, ep)
    expected = torch.cat([torch.full((n, 2), 100.0 * i + r) for i, n in enumerate(recv)])
    assert torch.equal(out, expected)
    # autograd all_to_all_v: gradient of sum(out * w) flows back to the right rows
    ta = t.clone().requires_grad_(True)
    out = C.all_to_all_v_autograd(ta, send, recv, ep)
    (out * out.detach()).sum().backward()
    assert torch.equal(ta.grad, t)
    # all_gather_v autograd: y = cat of uneven pieces on all ranks, dx = sum over ranks of dy slices
    xv = torch.full((r + 1, 2), float(r), requires_grad=True)
    y = C.all_gather_v_autograd(xv, ep)
    assert y.shape == (10, 2)
    (y * (ep.rank + 1)).sum().backward()
    assert torch.equal(xv.grad, torch.full((r + 1, 2), 10.0))
    # all_reduce autograd: dx_s = sum_r dy_r
    xa = torch.ones(3, requires_grad=True)
    (C.all_reduce_autograd(xa, ep) * (r + 1)).sum().backward()
    assert torch.equal(xa.grad, torch.full((3,), 10.0))
    # counts: rows sent per destination -> rows received per source
    counts = C.exchange_counts(torch.tensor([[r, i] for i in range(4)]), ep)
    assert counts.tolist() == [[i, r] for i in range(4)]
    return C.COMM_STATS.snapshot()


def test_collectives_values_autograd_and_bytes():
    stats = run_distributed(4, _check_collectives, dict(expert=2, expert_shard=2))
    s0 = stats[0]
    assert s0["all_reduce/ep_esp"] == 6 * 4 + 3 * 4 * 2  # 2x3 floats, then 3 floats fwd + bwd
    assert s0["all_gather/ep_esp"] >= 8 * 3 * 4
    # rank 0 sends 0+1+2+3 rows of 2 floats, twice (forward + backward sends recv-split rows = same)
    assert s0["all_to_all/ep_esp"] == 6 * 2 * 4 * 2 + 6 * 2 * 4


def _async_times(state):
    """Rank 1 joins each op 0.3 s late. Op 1: rank 0 works 0.5 s before waiting, so the transfer
    hides behind the work. Op 2: rank 0 waits at once and is blocked until rank 1 joins."""
    import time

    g, r = state.world, state.world.rank
    C.COMM_STATS.reset()
    out = {}
    for name, work_s in (("hidden", 0.5), ("exposed", 0.0)):
        if r == 1:
            time.sleep(0.3)
        pending = C.all_gather_v_async(torch.full((r + 1, 2), float(r)), g, [1, 2], kind=name)
        time.sleep(work_s if r == 0 else 0.0)
        gathered = pending.wait()
        assert gathered[:, 0].tolist() == [0.0, 1.0, 1.0]
        assert pending.wait() is not None  # a second wait records nothing more
        C.barrier(g)
    if r == 0:  # point-to-point: rank 1 sends 0.3 s late
        C.p2p_exchange([], [(1, torch.empty(4))], g, kind="p2p").wait()
    else:
        time.sleep(0.3)
        C.p2p_exchange([(0, torch.ones(4))], [], g, kind="p2p").wait()
    times = C.COMM_STATS.seconds_by_kind()
    return times, C.COMM_STATS.snapshot(), dict(C.COMM_STATS.calls)


def test_async_ops_record_exposed_and_total_time():
    """Async ops record the time blocked in wait() (exposed) and the span from issue to completion
    (total); a synchronous op's exposed time equals its total (collectives.py docstring)."""
    (times, nbytes, calls), (times1, nbytes1, _) = run_distributed(2, _async_times)
    exposed, total = times["exposed"], times["total"]
    assert total["hidden"] >= 0.45 and exposed["hidden"] < 0.15, times  # hidden behind 0.5 s of work
    assert exposed["exposed"] >= 0.25 and total["exposed"] >= exposed["exposed"], times  # blocked ~0.3 s
    assert exposed["p2p"] >= 0.25 and total["p2p"] >= exposed["p2p"], times  # receiver blocked
    # all-gather-v counts its gathered output; point-to-point the bytes sent (the receiver: 0)
    assert nbytes == {"hidden/world": 3 * 2 * 4, "exposed/world": 3 * 2 * 4, "p2p/world": 0}
    assert nbytes1["p2p/world"] == 4 * 4 and calls["hidden/world"] == 1

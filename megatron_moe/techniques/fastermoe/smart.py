"""FasterMoE's smart fine-grained schedule (He et al., PPoPP'22, §4.2, Fig. 7-8;
`moe.smart_schedule: true`, `moe.smart_group_size: g`).

The all-to-all, the expert computation and the all-to-all back of one layer become n steps of a
grouped pairwise exchange. The ranks of the exchange group (`ep` for the baseline, `ep_esp` for
Parm's S1 / S2) are split into n fine-grained groups of g EP ranks (with Parm, an EP rank's N_ESP
shard holders stay in one group); group i, in step j:

    S_ij: sends its rows for group t = (i - j) mod n, receives the rows of group f = (i + j) mod n
    C_ij: computes its experts on the rows from f (one expert batch: `Placement.receive_order_from`)
    R_ij: returns those outputs to f and receives its own rows' outputs from t

Every step's transfers are asynchronous point-to-point messages: S_i,j+1 is issued before C_ij
runs and R_ij right after it, so communication of one step overlaps computation of another (the
two-stream schedule of Fig. 8b on one compute stream). Step 0 is a group's own members, the
fastest link (Fig. 8c). Backward mirrors it: the gradient of step j's outputs arrives from f while
the previous step's backward computes, and the gradient of the rows goes back to their senders.

One autograd node (`_SmartExchange`) holds the whole pipeline: its forward keeps each step's
small compute graph (rows -> expert outputs; none when the caller's autograd is off, e.g.
evaluation under `torch.no_grad`) and its backward replays the steps in pipeline order,
back-propagating each graph when its output gradient has arrived (the expert weights' gradients
accumulate as in any backward; the replica weights' are summed over the steps and returned to
*Trans*, whose backward is *Agg*). The math is the plain schedule's: exactness is tested against the
single-process reference (tests/distributed/test_smart_schedule.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group
from megatron_moe.moe.experts import ExpertBatch
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.schedules.base import EXCHANGES, upload
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check

SMART_KIND = "smart_p2p"  # the pairwise exchanges' bytes (sent), forward and backward


@dataclass
class SmartPlan:
    """One layer's pairwise exchange on this rank."""

    group: Group  # the exchange group (ep or ep_esp); its ranks are the Placement's sources
    send_splits: List[int]  # rows this rank sends each peer (the plain all-to-all's splits)
    recv_splits: List[int]  # rows each peer sends this rank
    peer_group: int  # peers per fine-grained group (g EP ranks x their shard holders)
    placement: Placement
    ep_rank: int  # this rank's EP rank: whose experts it computes

    @property
    def steps(self) -> List[Tuple[List[int], List[int]]]:
        """[(peers sent to, peers received from)] per step: groups (i - j) and (i + j) mod n."""
        n, me = self.group.size // self.peer_group, self.group.rank // self.peer_group
        members = [list(range(k * self.peer_group, (k + 1) * self.peer_group)) for k in range(n)]
        return [(members[(me - j) % n], members[(me + j) % n]) for j in range(n)]

    def batch(self, rows: torch.Tensor, sources: Sequence[int]) -> Tuple[ExpertBatch, torch.Tensor]:
        """Rows received from `sources` (source-major, their order) -> (expert batch, its order).
        Every step's order and counts go down in one buffer at the first step (`upload`)."""
        if not hasattr(self, "_sent"):
            groups = [tuple(frm) for _, frm in self.steps]
            placement, q = self.placement, self.ep_rank
            host = [(placement.receive_order_from(q, g), torch.tensor(placement.expert_counts_from(q, g)))
                    for g in groups]
            sent = iter(upload([t for pair in host for t in pair], rows.device))
            self._sent = {g: (next(sent), next(sent)) for g in groups}
        order, counts = self._sent[tuple(sources)]
        return (ExpertBatch(rows.index_select(0, order), self.placement.experts_on(self.ep_rank),
                            self.placement.expert_counts_from(self.ep_rank, sources), counts), order)


def _offsets(splits: Sequence[int]) -> List[int]:
    out, total = [], 0
    for n in splits:
        out.append(total)
        total += n
    return out


def _exchange(plan: SmartPlan, outgoing: List[Tuple[int, torch.Tensor]], incoming: List[Tuple[int, torch.Tensor]],
              tag: int) -> C.Pending:
    """Send / receive per peer; a rank's message to itself is a local copy."""
    me = plan.group.rank
    for (q, src), (r, dst) in ((s, d) for s in outgoing if s[0] == me for d in incoming if d[0] == me):
        dst.copy_(src)
    return C.p2p_exchange([(q, t) for q, t in outgoing if q != me], [(r, t) for r, t in incoming if r != me],
                          plan.group, kind=SMART_KIND, tag=tag)


class _SmartExchange(torch.autograd.Function):
    """send [m_out, h] (rows ordered by destination peer) -> returned [m_out, h]: each row's expert
    output as computed by its destination, in the same order (the plain all-to-all -> experts ->
    all-to-all back). `compute(batch, replica_stacks) -> expert outputs` runs one step's batch."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, plan: SmartPlan, compute: Callable, track: bool, *replica_stacks):
        """`track`: the caller's grad mode (autograd is off inside a Function's forward): build
        each step's graph for backward only then."""
        hidden, steps = send.shape[1], plan.steps
        send_at, recv_sizes = _offsets(plan.send_splits), plan.recv_splits
        returned = send.new_empty(send.shape)
        leaves = [s.detach().requires_grad_(s.requires_grad) for s in replica_stacks]

        def post_rows(j):  # S_j: my rows for group t, rows of group f into fresh buffers
            to, frm = steps[j]
            bufs = [send.new_empty((recv_sizes[r], hidden)) for r in frm]
            rows = [(q, send.narrow(0, send_at[q], plan.send_splits[q])) for q in to]
            return bufs, _exchange(plan, rows, list(zip(frm, bufs)), tag=2 * j)

        graphs, pending, posted = [], [], post_rows(0)
        for j, (to, frm) in enumerate(steps):
            bufs, handle = posted
            handle.wait()
            if j + 1 < len(steps):
                posted = post_rows(j + 1)  # S_{j+1} in flight while C_j computes
            rows = torch.cat(bufs).requires_grad_(track)
            with torch.set_grad_enabled(track):
                batch, order = plan.batch(rows, frm)
                out = compute(batch, leaves).index_select(0, torch.argsort(order))  # [rows, h] source-major
            if track:
                graphs.append((rows, out))
            outs = out.detach().split([recv_sizes[r] for r in frm])
            mine = [(q, returned.narrow(0, send_at[q], plan.send_splits[q])) for q in to]
            pending.append(_exchange(plan, list(zip(frm, outs)), mine, tag=2 * j + 1))  # R_j
        for handle in pending:
            handle.wait()
        ctx.plan, ctx.graphs, ctx.leaves = plan, graphs, leaves
        ctx.send_shape, ctx.send_dtype = send.shape, send.dtype
        return returned

    @staticmethod
    def backward(ctx, grad_returned):
        plan, graphs, steps = ctx.plan, ctx.graphs, ctx.plan.steps
        send_at, recv_sizes = _offsets(plan.send_splits), plan.recv_splits
        grad_returned = grad_returned.contiguous()
        grad_send = grad_returned.new_empty(ctx.send_shape)
        base = 2 * len(steps)

        def post_grads(j):  # mirror of R_j: my rows' output gradients to t, group f's from f
            to, frm = steps[j]
            bufs = [grad_returned.new_empty((recv_sizes[r], grad_returned.shape[1])) for r in frm]
            grads = [(q, grad_returned.narrow(0, send_at[q], plan.send_splits[q])) for q in to]
            return bufs, _exchange(plan, grads, list(zip(frm, bufs)), tag=base + 2 * j)

        pending, posted = [], post_grads(0)
        for j, (to, frm) in enumerate(steps):
            bufs, handle = posted
            handle.wait()
            if j + 1 < len(steps):
                posted = post_grads(j + 1)
            rows, out = graphs[j]
            torch.autograd.backward(out, torch.cat(bufs))  # expert weights' gradients accumulate here
            row_grads = rows.grad.split([recv_sizes[r] for r in frm])
            mine = [(q, grad_send.narrow(0, send_at[q], plan.send_splits[q])) for q in to]
            pending.append(_exchange(plan, list(zip(frm, row_grads)), mine, tag=base + 2 * j + 1))  # mirror of S_j
        for handle in pending:
            handle.wait()
        replica_grads = tuple(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in ctx.leaves)
        return (grad_send, None, None, None) + replica_grads


def smart_exchange(send: torch.Tensor, plan: SmartPlan, compute: Callable, replicas=None) -> torch.Tensor:
    """`_SmartExchange` with the replica stacks of this forward (waited for Trans) as inputs."""
    stacks = tuple(replicas.stacks()) if replicas is not None else ()
    return _SmartExchange.apply(send, plan, compute, torch.is_grad_enabled(), *stacks)


def smart_peer_group(group_size_in_ep_ranks: int, esp_size: int, exchange_over_ep_esp: bool) -> int:
    """Peers per fine-grained group: g EP ranks, times their N_ESP shard holders on `ep_esp`."""
    return group_size_in_ep_ranks * (esp_size if exchange_over_ep_esp else 1)


__all__ = ["SmartPlan", "smart_exchange", "smart_peer_group", "SMART_KIND"]


@EXCHANGES.register("smart")
class Smart:
    """The smart schedule as the schedules reach it (moe/schedules/base.py `EXCHANGES`)."""

    late_expert_grads = "the smart schedule back-propagates each pairwise step on its own (a hook per step)"

    Plan = SmartPlan
    peer_group = staticmethod(smart_peer_group)
    exchange = staticmethod(smart_exchange)


@section_check("moe.smart_schedule")
def _check_smart(cfg, world_size: int) -> None:
    moe, par = cfg.moe, cfg.parallel
    if moe.smart_schedule and moe.saa:
        raise ConfigError("moe.smart_schedule=true and moe.saa=true cannot be combined: both reschedule S2's combine")
    if moe.smart_group_size < 1 or par.expert % moe.smart_group_size:
        raise ConfigError(f"moe.smart_group_size={moe.smart_group_size} must be >= 1 and divide "
                          f"parallel.expert={par.expert}")

"""The baseline MP+EP+ESP schedule, Parm Fig. 3(a) (DeepSpeed-TED style), redundancy included.

Forward, on every rank (p, j) = (EP rank, ESP rank) with its TP-replicated micro-batch x [n, h]:

 1. Gate: every TP rank routes its whole micro-batch (so each TP rank's copy of a token is routed,
    dispatched and computed: the N_MP-fold redundancy Parm removes).
 2. ESP-AllGather over `esp`: tokens G_p = cat_i x_(p,i) [n_G, h] (Eq. 1: AG_ESP(BLM x N_ESP)),
    plus the routing metadata (sizes, expert ids, combine weights; counted as
    "all_gather_routing"). Every ESP rank of p now holds the same G_p.
 3. Counts: kept assignments of G_p per expert, all-gathered over `ep` ("all_gather_counts") into
    counts [ep, E] -> balancer -> Placement (sources = `ep` ranks).
 4. EP-AlltoAll-v over `ep`: one row per kept assignment to the rank that computes it, splits from
    the placement's routing table (A2A_EP(ETM x N_ESP)). No padding.
 5. Experts: ESP shard j of each expert on all received rows -> partial sums.
 6. ESP-AllReduce over `esp` of the partial sums (AR_ESP(ETM x N_ESP)).
 7. EP-AlltoAll back (A2A_EP(ETM x N_ESP)); gate-weighted combine of G_p's rows.
 8. ESP-Split: keep this rank's own tokens (no communication).

Backward (Megatron's conjugate pairs): ESP-Split -> all-gather of dy; ESP-AllReduce -> identity
(each ESP rank then holds the full output gradient and backpropagates its own shard); the
ESP-AllGather of tokens -> reduce-scatter (sums the shards' input-gradient contributions); the
combine weights' gather -> keep own rows (every ESP rank computed their full gradient). Each
token copy reaches the experts once per TP rank, so `expert_grad_scale` = 1/N_MP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.moe.experts import ExpertBatch
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.router import Router
from megatron_moe.moe.schedules import SCHEDULES
from megatron_moe.moe.schedules.base import EXCHANGES, Routed, Schedule, slots_by_expert
from megatron_moe.tensor_parallel import reduce_from_tp_region

ROUTING_KIND = "all_gather_routing"  # byte-counter labels of the metadata collectives
COUNTS_KIND = "all_gather_counts"


@dataclass
class BaselineRouted(Routed):
    x: torch.Tensor  # [n, h] this rank's tokens
    sizes: List[int]  # tokens of each ESP rank
    weights: torch.Tensor  # [n_G, k] combine weights of the gathered tokens
    slots: torch.Tensor  # Long[m] kept assignment slots (token * k + choice) of G_p, ordered by expert


@dataclass
class _CombineContext:
    routed: BaselineRouted
    send_splits: List[int]
    recv_splits: List[int]
    send_order: torch.Tensor  # expert-ordered rows -> send buffer
    recv_order: Optional[torch.Tensor] = None  # received rows -> expert batch (set by dispatch)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


@SCHEDULES.register("baseline")
class BaselineSchedule(Schedule):
    def __init__(self, cfg, state):
        super().__init__(cfg, state)
        self.expert_grad_scale = 1.0 / state.tp_size

    def source_ep_ranks(self) -> List[int]:
        return list(range(self.state.ep_size))  # after the ESP-AllGather, the sources are the ep ranks

    def route(self, router: Router, x: torch.Tensor) -> BaselineRouted:
        routing = router(x)  # step 1: the whole TP-replicated micro-batch
        esp = self.state.esp
        sizes = C.all_gather_sizes(x.shape[0], esp, ROUTING_KIND)
        ids = routing.expert_ids.masked_fill(~routing.kept, -1)  # [n, k], -1 = dropped
        ids = C.all_gather_v(ids, esp, sizes, ROUTING_KIND).flatten()  # [n_G * k]
        weights = C.all_gather_v_autograd(routing.weights, esp, sizes, ROUTING_KIND, backward="split")
        slots = slots_by_expert(ids)  # by expert; gathered order within an expert
        local_counts = torch.bincount(ids[slots], minlength=router.num_experts)  # [E]
        counts = C.all_gather(local_counts, self.state.ep, kind=COUNTS_KIND).view(-1, router.num_experts)  # [ep, E]
        return BaselineRouted(routing, counts.cpu(), x, sizes, weights, slots)

    def _send_rows(self, routed: BaselineRouted, placement: Placement) -> Tuple[torch.Tensor, _CombineContext]:
        """Step 2 (ESP-AllGather) and the rows of G_p ordered by destination EP rank [m, h]."""
        esp, ep = self.state.esp, self.state.ep
        tokens = C.all_gather_v_autograd(routed.x, esp, routed.sizes)  # step 2: ESP-AllGather [n_G, h]
        rows = tokens.index_select(0, routed.slots // routed.weights.shape[1])  # [m, h] by expert
        send_order = torch.argsort(placement.destinations(ep.rank), stable=True).to(rows.device)
        ctx = _CombineContext(routed, placement.send_splits(ep.rank), placement.recv_splits(ep.rank), send_order)
        return rows.index_select(0, send_order), ctx

    def dispatch(self, routed: BaselineRouted, placement: Placement) -> Tuple[ExpertBatch, _CombineContext]:
        ep = self.state.ep
        send, ctx = self._send_rows(routed, placement)
        received = C.all_to_all_v_autograd(send, ctx.send_splits, ctx.recv_splits, ep,
                                           while_in_flight=self.hooks.in_flight(),
                                           backward_fill=self.backward_fill())  # step 4
        ctx.recv_order = placement.receive_order(ep.rank).to(send.device)
        batch = ExpertBatch(received.index_select(0, ctx.recv_order), placement.experts_on(ep.rank),
                            placement.expert_counts(ep.rank))
        return batch, ctx

    def combine(self, expert_output: torch.Tensor, ctx: _CombineContext) -> torch.Tensor:
        out = reduce_from_tp_region(expert_output, self.state.esp)  # step 6: ESP-AllReduce (Megatron g on esp)
        out = out.index_select(0, _inverse(ctx.recv_order))  # as received: source-major
        returned = C.all_to_all_v_autograd(out, ctx.recv_splits, ctx.send_splits, self.state.ep,
                                           while_in_flight=self.hooks.combining(), backward_fill=self.backward_fill())
        return self._finish(returned, ctx)  # step 7

    def _finish(self, returned: torch.Tensor, ctx: _CombineContext) -> torch.Tensor:
        """Steps 7-8 after the return trip: gate-weighted combine of G_p's rows, ESP-Split [n, h]."""
        routed = ctx.routed
        rows = returned.index_select(0, _inverse(ctx.send_order))  # [m, h] aligned with routed.slots
        k = routed.weights.shape[1]
        gate = routed.weights.flatten().index_select(0, routed.slots)  # [m]
        weighted = rows * gate.unsqueeze(1)
        y_gathered = weighted.new_zeros((routed.weights.shape[0], weighted.shape[1]))
        y_gathered = y_gathered.index_add(0, routed.slots // k, weighted)  # [n_G, h]
        return C.split_v_autograd(y_gathered, self.state.esp, routed.sizes)  # step 8: ESP-Split [n, h]

    def smart_parts(self, routed: BaselineRouted, placement: Placement):
        """Pairwise steps over `ep`; each step's partial sums are ESP-AllReduced before going back."""
        smart = EXCHANGES.get("smart")
        send, ctx = self._send_rows(routed, placement)
        peers = smart.peer_group(self.cfg.moe.smart_group_size, self.state.esp_size, exchange_over_ep_esp=False)
        plan = smart.Plan(self.state.ep, ctx.send_splits, ctx.recv_splits, peers, placement, self.state.ep.rank)
        return send, ctx, plan, lambda out: reduce_from_tp_region(out, self.state.esp)

    def smart_finish(self, returned: torch.Tensor, ctx: _CombineContext) -> torch.Tensor:
        return self._finish(returned, ctx)

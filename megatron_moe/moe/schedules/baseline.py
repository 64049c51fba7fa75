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
    the placement's routing table (A2A_EP(ETM x N_ESP)). No padding. How the rows travel is the
    token dispatch (`moe.token_dispatch`, registry `TOKEN_DISPATCH`): `per_copy` (here) sends
    each copy straight to its rank; `node_dedup` (techniques/node_dedup/node_dedup.py, DeepSeek-V3
    §3.2.2) sends a token once per node and forwards it inside the node (steps 4 and 7 in two hops).
 5. Experts: ESP shard j of each expert on all received rows -> partial sums.
 6. ESP-AllReduce over `esp` of the partial sums (AR_ESP(ETM x N_ESP)).
 7. EP-AlltoAll back (A2A_EP(ETM x N_ESP)); gate-weighted combine of G_p's rows (`per_copy`: at
    the source; `node_dedup`: partly on each node's proxy).
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

from megatron_moe.config.registry import Registry
from megatron_moe.config.validate import section_check
from megatron_moe.distributed import collectives as C
from megatron_moe.moe.experts import ExpertBatch
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.router import Router, kept_counts
from megatron_moe.moe.schedules import SCHEDULES
from megatron_moe.moe.schedules.base import (EXCHANGES, Routed, Schedule, permute_rows,
                                             slots_by_expert, unless_identity, upload)
from megatron_moe.perf import host_sync
from megatron_moe.tensor_parallel import reduce_from_tp_region

ROUTING_KIND = "all_gather_routing"  # byte-counter labels of the metadata collectives
COUNTS_KIND = "all_gather_counts"
# moe.token_dispatch: how steps 4 and 7 move G_p's rows; `cls(schedule)` has
#   dispatch(tokens [n_G, h], routed, placement) -> (ExpertBatch, ctx)
#   combine(expert_output [m, h] (ESP-summed), ctx) -> y_gathered [n_G, h]
# "per_copy" here, "node_dedup": techniques/node_dedup/node_dedup.py
TOKEN_DISPATCH: Registry = Registry("moe.token_dispatch")


@section_check("moe.token_dispatch")
def _check_token_dispatch(cfg, world_size: int) -> None:
    TOKEN_DISPATCH.get(cfg.moe.token_dispatch)


@dataclass
class BaselineRouted(Routed):
    x: torch.Tensor  # [n, h] this rank's tokens
    sizes: List[int]  # tokens of each ESP rank
    weights: torch.Tensor  # [n_G, k] combine weights of the gathered tokens
    slots: torch.Tensor  # Long[m] kept assignment slots (token * k + choice) of G_p, ordered by expert
    ids: torch.Tensor  # Long[n_G * k] expert of every slot of G_p, -1 = dropped


@dataclass
class _CombineContext:
    routed: BaselineRouted
    send_splits: List[int]
    recv_splits: List[int]
    send_order: Optional[torch.Tensor]  # expert-ordered rows -> send buffer (None: the identity)
    recv_order: Optional[torch.Tensor] = None  # received rows -> expert batch (None: the identity)
    expert_counts: Optional[torch.Tensor] = None  # Long[G] on the device: the batch's rows per expert


@TOKEN_DISPATCH.register("per_copy")
class PerCopy:
    """One row per kept assignment, straight to the EP rank computing it, and back (steps 4, 7)."""

    def __init__(self, schedule: "BaselineSchedule"):
        self.schedule = schedule

    def send_rows(self, tokens: torch.Tensor, routed: BaselineRouted, placement: Placement,
                  receiving: bool = True) -> Tuple[torch.Tensor, _CombineContext]:
        """G_p's rows [n_G, h] -> its kept assignments' rows ordered by destination EP rank [m, h].
        The host's orders (and with `receiving`, the receive order and the batch's counts) go
        down in one buffer."""
        ep = self.schedule.state.ep
        rows = tokens.index_select(0, routed.slots // routed.weights.shape[1])  # [m, h] by expert
        alone = placement.ep_size == 1  # one EP rank, one source: both orders keep the rows in place
        send_order = None if alone else unless_identity(torch.argsort(placement.destinations(ep.rank), stable=True))
        recv_order = unless_identity(placement.receive_order(ep.rank)) if receiving and not alone else None
        counts = torch.tensor(placement.expert_counts(ep.rank), dtype=torch.long) if receiving else None
        send_order, recv_order, counts = upload([send_order, recv_order, counts], rows.device)
        ctx = _CombineContext(routed, placement.send_splits(ep.rank), placement.recv_splits(ep.rank), send_order,
                              recv_order, counts)
        return permute_rows(rows, send_order), ctx

    def dispatch(self, tokens: torch.Tensor, routed: BaselineRouted,
                 placement: Placement) -> Tuple[ExpertBatch, _CombineContext]:
        s, ep = self.schedule, self.schedule.state.ep
        send, ctx = self.send_rows(tokens, routed, placement)
        received = C.all_to_all_v_autograd(send, ctx.send_splits, ctx.recv_splits, ep,  # step 4
                                           while_in_flight=s.hooks.in_flight(), backward_fill=s.backward_fill())
        batch = ExpertBatch(permute_rows(received, ctx.recv_order), placement.experts_on(ep.rank),
                            placement.expert_counts(ep.rank), ctx.expert_counts)
        return batch, ctx

    def combine(self, out: torch.Tensor, ctx: _CombineContext) -> torch.Tensor:
        s = self.schedule
        out = permute_rows(out, ctx.recv_order, inverse=True)  # as received: source-major
        returned = C.all_to_all_v_autograd(out, ctx.recv_splits, ctx.send_splits, s.state.ep,
                                           while_in_flight=s.hooks.combining(), backward_fill=s.backward_fill())
        return self.finish(returned, ctx)  # step 7

    def finish(self, returned: torch.Tensor, ctx: _CombineContext) -> torch.Tensor:
        """Rows as returned [m, h] -> gate-weighted combine of G_p's rows [n_G, h]."""
        routed = ctx.routed
        rows = permute_rows(returned, ctx.send_order, inverse=True)  # [m, h] aligned with routed.slots
        return self.schedule.weighted_sum(rows, routed.weights, routed.slots, routed.weights.shape[0])


@SCHEDULES.register("baseline")
class BaselineSchedule(Schedule):
    def __init__(self, cfg, state):
        super().__init__(cfg, state)
        self.expert_grad_scale = 1.0 / state.tp_size
        self.token_dispatch = TOKEN_DISPATCH.get(cfg.moe.token_dispatch)(self)

    def source_ep_ranks(self) -> List[int]:
        return list(range(self.state.ep_size))  # after the ESP-AllGather, the sources are the ep ranks

    def route(self, router: Router, x: torch.Tensor) -> BaselineRouted:
        routing = router(x)  # step 1: the whole TP-replicated micro-batch
        esp, ep = self.state.esp, self.state.ep
        # every rank of a stage routes micro-batches of the same b*s tokens (the config's shapes):
        # the ESP ranks' sizes need no exchange (and no host read of one)
        sizes = [x.shape[0]] * esp.size
        dropless = routing.capacity is None  # every assignment kept: no -1 ids, the kept counts are the router's
        ids = routing.expert_ids if dropless else routing.expert_ids.masked_fill(~routing.kept, -1)  # [n, k], -1 = dropped
        ids = C.all_gather_v(ids, esp, sizes, ROUTING_KIND).flatten()  # [n_G * k]
        weights = C.all_gather_v_autograd(routing.weights, esp, sizes, ROUTING_KIND, backward="split")
        num_experts = router.num_experts
        local_counts = (routing.tokens_per_expert if dropless and esp.size == 1
                        else kept_counts(ids, ids >= 0, num_experts))  # [E]
        counts = C.all_gather(local_counts, ep, kind=COUNTS_KIND).view(-1, num_experts)  # [ep, E]
        counts = host_sync.to_host(counts, "counts")  # the forward's one host read
        slots = slots_by_expert(ids, int(counts[ep.rank].sum()))  # by expert; gathered order within an expert
        return BaselineRouted(routing, counts, x, sizes, weights, slots, ids)

    def _gathered(self, routed: BaselineRouted) -> torch.Tensor:
        """Step 2: ESP-AllGather of the tokens, G_p [n_G, h]."""
        return C.all_gather_v_autograd(routed.x, self.state.esp, routed.sizes)

    def dispatch(self, routed: BaselineRouted, placement: Placement):
        batch, ctx = self.token_dispatch.dispatch(self._gathered(routed), routed, placement)  # step 4
        return batch, (routed, ctx)

    def combine(self, expert_output: torch.Tensor, ctx) -> torch.Tensor:
        routed, dispatched = ctx
        out = reduce_from_tp_region(expert_output, self.state.esp)  # step 6: ESP-AllReduce (Megatron g on esp)
        y_gathered = self.token_dispatch.combine(out, dispatched)  # step 7
        return C.split_v_autograd(y_gathered, self.state.esp, routed.sizes)  # step 8: ESP-Split [n, h]

    def smart_parts(self, routed: BaselineRouted, placement: Placement):
        """Pairwise steps over `ep`; each step's partial sums are ESP-AllReduced before going back."""
        assert isinstance(self.token_dispatch, PerCopy), "the config check refuses the smart schedule otherwise"
        smart = EXCHANGES.get("smart")
        send, ctx = self.token_dispatch.send_rows(self._gathered(routed), routed, placement, receiving=False)
        peers = smart.peer_group(self.cfg.moe.smart_group_size, self.state.esp_size, exchange_over_ep_esp=False)
        plan = smart.Plan(self.state.ep, ctx.send_splits, ctx.recv_splits, peers, placement, self.state.ep.rank)
        return send, ctx, plan, lambda out: reduce_from_tp_region(out, self.state.esp)

    def smart_finish(self, returned: torch.Tensor, ctx: _CombineContext) -> torch.Tensor:
        y_gathered = self.token_dispatch.finish(returned, ctx)  # step 7
        return C.split_v_autograd(y_gathered, self.state.esp, ctx.routed.sizes)  # step 8

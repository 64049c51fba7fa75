"""Node-deduplicated token dispatch: `moe.token_dispatch: node_dedup` (DeepSeek-V3, arXiv:2412.19437,
§3.2.2 "Efficient Implementation of Cross-Node All-to-All Communication"; deepseek-ai/DeepEP's
internode kernels). The baseline schedule's EP-AlltoAll pair (moe/schedules/baseline.py steps 4
and 7) in two hops, so that a token crosses the network once per node that computes it, not once
per expert: what makes node-limited routing (`moe.router_groups` / `moe.router_group_topk`,
moe/router.py) pay off in inter-node bytes.

Nodes are those of the `ep` group's members (`Group.node_of`: `parallel.ranks_per_node`). A
source p (an EP rank holding G_p [n_G, h] after the ESP-AllGather) sends token t to node N iff
one of t's kept assignments is computed on N (the placement's `destinations`, so replicas and
vExperts count where they compute). On node N a proxy receives it: p itself on p's own node,
else the member of N with p's local index on its node (modulo N's members; DeepEP's rule: rank
i of one node talks to rank i of the others).

Forward, on EP rank p (hop 1 on `ep`, one ESP rank's `ep` group each, as the baseline; hop 2 on
`ep_node`, the members of p's `ep` group on p's node: distributed/parallel_state.py)::

    hop 1  (network)  rows [R_p, h]: one per (token, node) pair of G_p, ordered by node then token,
                      to the node's proxy; with them the pair's routing, codes Long[R_p, k]
                      (expert * ep + computing rank, -1 for choices off that node or dropped) and
                      the token's combine weights [R_p, k] (kind all_to_all_routing), after the
                      rows per proxy (`exchange_counts`, kind all_to_all_counts, ep int64s)
    hop 2  (in node)  the proxy copies each received row once per valid code to its rank, ordered
                      by (rank, expert), over `ep_node` (the splits per `ep` member restricted to
                      the node's, `_in_node`) -> each rank gets blocks per (proxy, expert), which it
                      regroups expert-major (`expert_major_order`) into the ExpertBatch
    experts, ESP-AllReduce (the baseline's steps 5-6)
    hop 2 back        the copies' outputs to their proxies (in node, `ep_node`)
    proxy             partial [R', h]: sum over a row's copies of weight * output (`gate_weighted_sum`),
                      cast to the rows' dtype (bf16 under bf16, as DeepEP's combine)
    hop 1 back        one row per (token, node) to the source (network), which adds them up: y [n_G, h]

Backward reverses every all-to-all; the combine weights' gradient (<dy, output> per copy) is
computed on the proxy and returns with hop 1's backward, so the router learns as per copy.

Bytes per rank and forward, rows of h elements (`collectives.py` counts an all-to-all's whole
input, the rows a rank keeps included, as "<kind>/<group>"; "inter-node" is the part sent to other
nodes):

    hop 1 + hop 1 back:  R_p + R'_p rows (all_to_all/ep), of which (R_p - own-node pairs) + (R'_p -
                         rows from own-node sources) inter-node; R'_p = rows p receives as a proxy
    hop 2 + hop 2 back:  F_p + M_p rows (all_to_all/ep_node), none inter-node (F_p: copies p
                         forwards, M_p: rows it computes); nothing when p is its node's only member
                         of the ep group (a collective on one rank is a no-op)
    metadata:            R_p k (8 + 4) (all_to_all_routing/ep) + 8 ep (all_to_all_counts/ep)

Backward sends the same token bytes again and R'_p k 4 of weight gradients. Per copy a rank sends
C_p + M_p rows (C_p: its kept assignments), C_p^off + M_p^off of them inter-node; with k experts
on one node a token costs one inter-node row here and k per copy. docs/node_dedup.md has the
formula worked through and the measured numbers.

Composes with every balancer (it executes any Placement), the gates, Lancet, recomputation and
pipelines; refused with Parm's s1 / s2 / auto (their EP&ESP-AlltoAll over `ep_esp`, not built in
two hops) and the smart schedule (pairwise steps per copy), in `_check`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.group import Group
from megatron_moe.moe.experts import ExpertBatch
from megatron_moe.moe.placement import Placement, expert_major_order
from megatron_moe.moe.schedules.base import inverse_permutation, upload
from megatron_moe.moe.schedules.baseline import TOKEN_DISPATCH, BaselineRouted
from megatron_moe.perf.host_sync import to_host_all

ROUTING_KIND = "all_to_all_routing"  # hop 1's codes and combine weights (and the weights' gradients)


@dataclass(frozen=True)
class NodeProxies:
    """The members of a group by node, and which member receives a source's rows on each node."""

    node: Tuple[int, ...]  # [size] node of each member, numbered 0.. in member order
    members: Tuple[Tuple[int, ...], ...]  # [nodes] each node's members, ascending

    @classmethod
    def of(cls, group: Group) -> "NodeProxies":
        hosts = [group.node_of(i) for i in range(group.size)]
        numbers = {host: i for i, host in enumerate(sorted(set(hosts)))}
        node = tuple(numbers[h] for h in hosts)
        # members ascend by global rank, nodes are blocks of consecutive ranks: each node's members
        # are consecutive, so "by node" is "by member" (hop 1's send buffer relies on it)
        assert list(node) == sorted(node), node
        return cls(node, tuple(tuple(i for i, n in enumerate(node) if n == j) for j in range(len(numbers))))

    @property
    def num_nodes(self) -> int:
        return len(self.members)

    def proxy(self, source: int, node: int) -> int:
        """The member on `node` receiving `source`'s rows for it: the source on its own node, else the
        member with the source's local index on its node (modulo `node`'s members)."""
        if self.node[source] == node:
            return source
        local = self.members[self.node[source]].index(source)
        return self.members[node][local % len(self.members[node])]


@dataclass
class _Context:
    routed: BaselineRouted
    row_token: torch.Tensor  # Long[R] hop 1's rows: the G_p token each one carries
    send: List[int]  # hop 1 rows to each member
    recv: List[int]  # hop 1 rows from each member (this rank as a proxy)
    weights: torch.Tensor  # [R', k] combine weights of the received rows
    forwarded: torch.Tensor  # Long[F] hop 2's copies: received row * k + choice, by (rank, expert)
    send2: List[int]  # hop 2 copies to each ep_node member
    recv2: List[int]  # hop 2 copies from each ep_node member (proxy)
    recv_order: torch.Tensor  # Long[M] hop 2's received copies -> the expert batch


@TOKEN_DISPATCH.register("node_dedup")
class NodeDedup:
    """The baseline's steps 4 and 7 in two hops (module docstring)."""

    def __init__(self, schedule):
        self.schedule = schedule
        ep, self.ep_node = schedule.state.ep, schedule.state.ep_node
        self.proxies = NodeProxies.of(ep)
        self.node = torch.tensor(self.proxies.node)  # Long[ep]
        mine = self.proxies.node[ep.rank]
        # Long[nodes]: the member receiving this rank's rows for each node (hop 1)
        self.proxy_of_node = torch.tensor([self.proxies.proxy(ep.rank, node) for node in range(self.proxies.num_nodes)])
        # Long[ep]: the proxy on this rank's node of each source (the sources are the ep ranks)
        self.via = torch.tensor([self.proxies.proxy(s, mine) for s in range(ep.size)])
        self.proxied = [s for s in range(ep.size) if self.proxies.proxy(s, mine) == ep.rank]  # sources proxied here
        # ep_node's members are ep's on this node: consecutive ep ranks, this slice of them
        members = self.proxies.members[mine]
        self.on_node = slice(members[0], members[-1] + 1)
        assert ep.ranks[self.on_node] == self.ep_node.ranks, (ep.ranks, self.ep_node.ranks)

    def _in_node(self, per_member: List[int]) -> List[int]:
        """Hop 2's split per `ep` member -> per `ep_node` member; every row stays on this node."""
        inside = per_member[self.on_node]
        assert sum(inside) == sum(per_member), (per_member, self.on_node)  # counts are >= 0
        return inside

    def _pairs(self, routed: BaselineRouted, dest: torch.Tensor, dest_node: torch.Tensor, proxy_of_node: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hop 1 on the source, on the device (`dest`, `dest_node` Long[m]: the EP rank computing
        each kept slot and its node): (Long[m] each slot's (node, token) key sorted, the slots'
        order into it, Long[m] each slot's pair index, Long[ep] rows to each member). A sort
        instead of `torch.unique`, which reads the pair count on the host."""
        ep, n = self.schedule.state.ep, routed.weights.shape[0]
        key = dest_node * n + routed.slots // routed.weights.shape[1]  # [m] (node, token)
        key_sorted, order = torch.sort(key, stable=True)
        first = torch.ones_like(key_sorted, dtype=torch.bool)
        first[1:] = key_sorted[1:] != key_sorted[:-1]  # [m] a pair's first slot
        pair_sorted = first.long().cumsum(0) - 1  # [m] pair index, by node then token
        row = torch.empty_like(pair_sorted).scatter_(0, order, pair_sorted)
        per_node = torch.zeros(self.proxies.num_nodes, dtype=torch.long, device=key.device).scatter_add_(
            0, key_sorted // n, first.long())  # [nodes] pairs
        send = torch.zeros(ep.size, dtype=torch.long, device=key.device).index_add_(0, proxy_of_node, per_node)
        return key_sorted, pair_sorted, row, send

    def _arriving(self, placement: Placement) -> torch.Tensor:
        """Long[ep, E]: hop 2 copies per (proxy, expert) this rank receives: source s's rows of
        expert e for it (routing_table[s, e, q]) come through s's proxy on this node."""
        q = self.schedule.state.ep.rank
        table = placement.routing_table[:, :, q]  # [S, E]
        return table.new_zeros(table.shape).index_add_(0, self.via, table)

    def dispatch(self, tokens: torch.Tensor, routed: BaselineRouted,
                 placement: Placement) -> Tuple[ExpertBatch, _Context]:
        s, dev = self.schedule, tokens.device
        ep, k, n = s.state.ep, routed.weights.shape[1], routed.weights.shape[0]
        num_experts = placement.routing_table.shape[1]
        # hop 2 as a proxy, from the placement on the host: the copies forwarded to each member
        # (sources whose proxy here this rank is) and received from each proxy
        send2 = placement.routing_table[self.proxied].sum((0, 1))[self.on_node].tolist()  # their copies for this node
        arriving = self._arriving(placement)  # [ep, E]: zero rows off this node
        recv2 = self._in_node(arriving.sum(1).tolist())
        dest = placement.destinations(ep.rank)  # [m] EP rank computing each kept slot
        dest, dest_node, proxy_of_node, recv_order, counts = upload(  # one buffer down
            [dest, self.node[dest], self.proxy_of_node, expert_major_order(arriving, placement.experts_on(ep.rank)),
             torch.tensor(placement.expert_counts(ep.rank), dtype=torch.long)], dev)
        key_sorted, pair_sorted, row, send = self._pairs(routed, dest, dest_node, proxy_of_node)
        recv = C.exchange_counts(send.view(-1, 1), ep).flatten()
        send, recv = (t.tolist() for t in to_host_all([send, recv], "node_dedup rows"))  # a host sync
        pairs = key_sorted.new_zeros(sum(send)).scatter_(0, pair_sorted, key_sorted)  # [R] by node then token
        row_token, slots = pairs % n, routed.slots
        codes = torch.full((pairs.numel(), k), -1, dtype=torch.long, device=dev)
        codes[row, slots % k] = routed.ids[slots] * ep.size + dest
        codes = C.all_to_all_v(codes, send, recv, ep, kind=ROUTING_KIND)  # [R', k]
        weights = C.all_to_all_v_autograd(routed.weights.index_select(0, row_token), send, recv, ep, kind=ROUTING_KIND)
        rows = C.all_to_all_v_autograd(tokens.index_select(0, row_token), send, recv, ep,  # hop 1 [R', h]
                                       while_in_flight=s.hooks.in_flight(), backward_fill=s.backward_fill())
        code = codes.flatten()  # [R' k] received row * k + choice
        key = torch.where(code >= 0, (code % ep.size) * num_experts + code // ep.size, ep.size * num_experts)
        forwarded = torch.argsort(key, stable=True)[:sum(send2)]  # [F] valid codes by (rank, expert)
        copies = C.all_to_all_v_autograd(rows.index_select(0, forwarded // k), send2, recv2,  # hop 2 [M, h]
                                         self.ep_node, backward_fill=s.backward_fill())
        batch = ExpertBatch(copies.index_select(0, recv_order), placement.experts_on(ep.rank),
                            placement.expert_counts(ep.rank), counts)
        return batch, _Context(routed, row_token, send, recv, weights, forwarded, send2, recv2, recv_order)

    def combine(self, out: torch.Tensor, ctx: _Context) -> torch.Tensor:
        s = self.schedule
        ep, fill = s.state.ep, s.backward_fill()
        out = out.index_select(0, inverse_permutation(ctx.recv_order))  # as received: proxy-major
        back = C.all_to_all_v_autograd(out, ctx.recv2, ctx.send2, self.ep_node,  # hop 2 back [F, h]
                                       backward_fill=fill)
        partial = s.weighted_sum(back, ctx.weights, ctx.forwarded, ctx.weights.shape[0]).to(back.dtype)  # [R', h]
        returned = C.all_to_all_v_autograd(partial, ctx.recv, ctx.send, ep,  # hop 1 back [R, h]
                                           while_in_flight=s.hooks.combining(), backward_fill=fill)
        n, dtype = ctx.routed.weights.shape[0], torch.promote_types(returned.dtype, ctx.routed.weights.dtype)
        return returned.new_zeros((n, returned.shape[1]), dtype=dtype).index_add(0, ctx.row_token, returned.to(dtype))


@section_check("moe.node_dedup")
def _check(cfg, world_size: int) -> None:
    """What the two hops run with: the baseline schedule without the smart schedule."""
    moe = cfg.moe
    if moe.token_dispatch != "node_dedup":
        return
    if moe.schedule != "baseline":
        raise ConfigError(f"moe.token_dispatch=node_dedup needs moe.schedule=baseline, not {moe.schedule!r}: "
                          "Parm's EP&ESP-AlltoAll sends every row to each ESP shard holder over ep_esp and has no "
                          "two-hop form")
    if moe.smart_schedule:
        raise ConfigError("moe.token_dispatch=node_dedup cannot be combined with moe.smart_schedule=true: the smart "
                          "schedule's pairwise steps send one row per (token, expert) copy")

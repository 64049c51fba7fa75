"""Parm's dedicated MP+EP+ESP schedules (Pan et al., "Parm", §III-V): PauseMP S1 and S2,
EP&ESP-AlltoAll, SAA, and the automatic choice between S1 and S2.

The baseline (`baseline.py`, Fig. 3(a)) routes and computes each token once per TP rank. PauseMP
splits the TP-replicated micro-batch over the TP group instead (MP-Split) and restores it at the
end (MP-AllGather), so every token is computed once: `expert_grad_scale` = 1.

S1, Fig. 3(b) (`moe.schedule: s1`)
  1. MP-Split before the gate: TP rank t keeps tokens [o_t, o_t + n_t) (n_t = n / tp, the first
     n % tp ranks one more).
  2. Gate on those tokens. Per-expert counts are all-gathered over `tp`, so capacity positions
     (`capacity_keep(prior_counts=...)`) and the aux-loss fractions f_e cover the whole
     micro-batch; the aux/z-loss token sums are all-reduced. Routing, drops, losses = baseline's.
  3. EP&ESP-AlltoAll, experts, EP&ESP-AlltoAll + local combine (below).
  4. Gate-weighted combine of the own tokens, MP-AllGather [n, h]: Eq. 11's AG_MP(BLM).
S2, Fig. 3(c) (`moe.schedule: s2`)
  1. Gate on the replicated micro-batch (the same routing on every TP rank).
  2. MP-Split after the gate: expert e's m_e kept assignments (token order) are dealt to the TP
     ranks in contiguous chunks (m_e / tp, the first m_e % tp ranks one more).
  3. EP&ESP-AlltoAll, experts, EP&ESP-AlltoAll + local combine.
  4. MP-AllGather of the expert outputs (AG_MP(ETM)), gate-weighted combine on every TP rank.
SAA, §III-D / Fig. 5 (`moe.saa: true`; false = AAS, all-to-all then all-gather)
  S2's second EP&ESP-AlltoAll runs as N_EP phases of point-to-point exchanges on `ep_esp`: in
  phase i every rank (p, j) sends to EP rank (p + i) mod N_EP's shard holders and receives the
  partial sums of the N_ESP shards of EP rank (p - i) mod N_EP, adds them (local combine) and
  starts their all-gather on `tp` while phase i + 1 runs (two groups, concurrent). The paper's
  phases are one per peer; grouping the N_ESP shards of one EP rank into a phase lets the
  MP-AllGather carry combined rows (ETM) rather than N_ESP partial sums. The same phased
  exchange is the backward of S2's dispatch (reverse all-to-all, then the MP-Split's all-gather).
auto, §V / Alg. 1 (`moe.schedule: auto`, `perf.hardware_profile`)
  route -> plan -> choose, per layer and forward:
  1. Gate on the replicated micro-batch, like S2 (deliberately not S1's MP-Split first: the
     choice needs the micro-batch's counts, and routing it whole costs each TP rank the gate of
     B L tokens instead of B L / N_MP, E / (2 k ffn) of the expert FLOPs; docs/parm.md).
  2. Both candidates' per-source counts (S1: each TP rank's token piece; S2: each TP rank's chunk
     of every expert) are computed locally from the replicated routing and all-gathered over
     `ep_esp` in one collective; the balancer plans a Placement for each.
  3. Alg. 1 (`techniques/parm/parm_model.py`) compares t_D1 (E T from S1's placement rows) with t_D2 (from
     S2's). Every member of an `ep_esp` group computes the same numbers from the same gathered
     counts; when a TP group spans several `ep_esp` groups (tensor > expert * expert_shard) the two
     E T estimates are max-reduced over `tp` first. So one pick holds for every rank that shares a
     collective, and S1 runs its plain EP&ESP-AlltoAll while SAA runs only under S2.
  S1 picked: tokens and combine weights are MP-Split after the gate. `MoEStats.schedule`
  records the pick.

EP&ESP-AlltoAll, §III-C / Fig. 4(c)(d): one all-to-all-v over `ep_esp` whose Placement sources
are its ep * esp ranks. Local Dump: a row for EP rank q goes to each of q's N_ESP shard holders
(ep_esp rank q * esp + j). Local combine: the N_ESP partial sums returned for a row are added
(b2 counted once, `experts.py`). The return trip is the dispatch's adjoint, and vice versa.

Gradients (`moe/layer.py` contract: every TP rank back-propagates the same loss). An MP-Split of
a replicated tensor back-propagates as an all-gather of the pieces' gradients; an MP-AllGather
whose result every TP rank uses alike, as "keep own rows". S1's gate sees only the own tokens, so
the router weight enters through `copy_to_tp_region` (identity forward, all-reduce backward: the
full router gradient on every TP rank, which the trainer averages over tp) and the aux-loss sums
through `reduce_from_tp_region` (every TP rank back-propagates the same aux loss, so the
all-reduce's backward is the identity). S2 and auto gate on every TP rank: full router gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import Callable, List, Optional, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.experts import ExpertBatch
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.router import Router, Routing, capacity_keep, expert_counts, kept_counts, losses_from_sums
from megatron_moe.moe.schedules import SCHEDULES
from megatron_moe.moe.schedules.base import Routed, Schedule, even_split, slots_by_expert, upload
from megatron_moe.perf.host_sync import to_host, to_host_all
from megatron_moe.moe.stats import MoEStats
from megatron_moe.perf.hardware import PARM_OPS, configured_profile
from megatron_moe.techniques.parm.parm_model import choose_schedule, dispatched_assignments
from megatron_moe.tensor_parallel import copy_to_tp_region, reduce_from_tp_region
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check
from megatron_moe.perf.hardware import PROFILE_NEEDS

COUNTS_KIND = "all_gather_counts"  # byte-counter labels of the metadata collectives
ROUTING_KIND = "all_gather_routing"
SAA_KIND = "all_to_all_p2p"  # SAA's phased all-to-all: bytes actually sent (own slice excluded)
CHOICE_KIND = "auto_choice"  # auto's E T estimates, max-reduced over tp when a TP group spans ep_esp groups


@dataclass
class ParmRouted(Routed):
    choice: str  # "s1" (tokens split over tp) | "s2" (each expert's assignments split over tp)
    tokens: torch.Tensor  # [n_src, h] S1: this TP rank's tokens; S2: the whole micro-batch
    weights: torch.Tensor  # [n_src, k] combine weights of `tokens`
    # Long[m] kept slots (token * k + choice) of `tokens`, experts ascending: S1 this rank's;
    # S2 every TP rank's piece, in TP rank order
    slots: torch.Tensor
    piece_rows: Optional[List[int]]  # S2: rows of each TP rank's piece of `slots`; S1: None
    token_sizes: Optional[List[int]]  # S1: tokens of each TP rank (its MP-AllGather); S2: None
    dropped: torch.Tensor  # Long scalar on the device: assignments of the whole micro-batch dropped by capacity


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return t.cumsum(0) - t


def _block_index(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Long[total = sum(lengths)] (`total` known on the host): the indices of blocks
    [starts[b], starts[b] + lengths[b]), concatenated."""
    within = torch.arange(total, device=lengths.device)
    within = within - torch.repeat_interleave(_exclusive_cumsum(lengths), lengths, output_size=total)
    return torch.repeat_interleave(starts, lengths, output_size=total) + within


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _kept_slots(expert_ids: torch.Tensor, kept: torch.Tensor, m: int) -> torch.Tensor:
    """Long[m]: the m kept slots (token * k + choice) ordered by expert, token order within an expert."""
    return slots_by_expert(expert_ids.masked_fill(~kept, -1), m)


def _route_tp_piece(router: Router, piece: torch.Tensor, num_tokens: int, tp) -> Routing:
    """S1 step 2: route this TP rank's `piece` [n_t, h] of a `num_tokens`-token micro-batch (or of
    one Lancet part of it, `router.partition`) with the whole micro-batch's capacity positions and
    losses (router.py's math)."""
    num_experts = router.num_experts
    logits = router.logits(piece, lambda p: copy_to_tp_region(p, tp))  # [n_t, E] fp32
    probs, expert_ids, weights = router.select(logits)
    counts = expert_counts(expert_ids, num_experts)
    counts = C.all_gather(counts, tp, kind=COUNTS_KIND).view(tp.size, num_experts)  # [tp, E]
    tokens_per_expert = counts.sum(0)
    # token sums of the router probabilities and of logsumexp^2 over the TP pieces [E + 1]
    sums = reduce_from_tp_region(torch.cat([probs.sum(0), torch.logsumexp(logits, dim=-1).pow(2).sum().view(1)]), tp)
    part_prior = None
    if router.partition is not None:  # Lancet part: losses once every part is routed
        part_prior = router.partition.next_part(tokens_per_expert, sums[:num_experts], sums[num_experts])
        aux_loss = logits.new_zeros(())
    else:
        aux_loss = losses_from_sums(router, sums[:num_experts] / num_tokens, sums[num_experts] / num_tokens,
                                    tokens_per_expert, num_tokens)
    prior = counts[: tp.rank].sum(0) + (part_prior if part_prior is not None else 0)
    capacity = router.capacity(num_tokens)
    kept = capacity_keep(expert_ids, num_experts, capacity, prior_counts=prior)
    return Routing(expert_ids, weights, kept, tokens_per_expert, aux_loss, capacity, part_prior)


class EpEspExchange:
    """EP&ESP-AlltoAll of this rank for one forward (§III-C) with, for S2, the MP-Split before it
    and the MP-AllGather after it. `down`: rows [m, h] -> expert batch rows; `up`: expert outputs
    -> rows [m, h]; each is the other's backward (`_Exchange`)."""

    def __init__(self, state: ParallelState, placement: Placement, piece_rows: Optional[List[int]],
                 saa: bool, device: torch.device):
        self.state, self.piece_rows, self.saa = state, piece_rows, saa
        self.in_flight: Optional[Callable[[], None]] = None  # run during the next `down`'s all-to-all
        self.combining: Optional[Callable[[], None]] = None  # run during the forward's `up` (RunHooks)
        self.backward_fill: Optional[Callable[[int], None]] = None  # Lancet: runs during backward's all-to-alls
        source, p, esp = state.ep_esp.rank, state.ep.rank, state.esp_size
        self.per_ep = placement.send_splits(source)  # [ep] own rows for each EP rank
        send_order = torch.argsort(placement.destinations(source), stable=True)  # by destination EP rank
        per_ep = torch.tensor(self.per_ep, dtype=torch.long)
        self.rows = sum(self.per_ep)
        dumped = _block_index(_exclusive_cumsum(per_ep).repeat_interleave(esp), per_ep.repeat_interleave(esp),
                              self.rows * esp)
        self.send_splits = [n for n in self.per_ep for _ in range(esp)]  # [ep * esp]
        self.recv_splits = placement.recv_splits(p)  # [ep * esp] rows from each source
        recv_order = placement.receive_order(p)  # source-major -> expert-major
        peers = self._local_peers(placement) if saa else None  # (SAA) known here, or None: exchanged
        # every order this forward needs and the expert batch's counts: one buffer down
        # (local Dump: EP rank q's block once per shard holder)
        sent = upload([send_order[dumped], send_order, recv_order, _inverse(recv_order),
                       torch.tensor(placement.expert_counts(p), dtype=torch.long)]
                      + [order for _, _, order in peers or []], device)
        self.dump, self.send_order, self.recv_order, self.recv_inverse, self.expert_counts = sent[:5]
        self.offset = sum(piece_rows[: state.tp.rank]) if piece_rows else 0
        self.peers = None
        if saa:
            self.peers = ([(q, splits, order) for (q, splits, _), order in zip(peers, sent[5:])] if peers is not None
                          else self._peers(device))

    def down(self, rows: torch.Tensor, in_flight: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """`in_flight`: work during the all-to-all (else the forward's `self.in_flight`, once)."""
        if self.piece_rows is not None:  # MP-Split (S2)
            rows = rows.narrow(0, self.offset, self.rows)
        received = C.all_to_all_v(rows.index_select(0, self.dump), self.send_splits, self.recv_splits,
                                  self.state.ep_esp, while_in_flight=in_flight or self.in_flight)
        self.in_flight = None  # the forward's dispatch only (RunHooks)
        return received.index_select(0, self.recv_order)

    def up(self, out: torch.Tensor, in_flight: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """`in_flight`: work during the all-to-all (SAA: during its first phase)."""
        out = out.index_select(0, self.recv_inverse)  # source-major
        if self.saa:
            return self._phased_up(out, in_flight)
        returned = C.all_to_all_v(out, self.recv_splits, self.send_splits, self.state.ep_esp, while_in_flight=in_flight)
        rows = out.new_zeros((self.rows, out.shape[1])).index_add_(0, self.dump, returned)  # local combine
        return C.all_gather_v(rows, self.state.tp, self.piece_rows) if self.piece_rows is not None else rows

    # -- SAA ------------------------------------------------------------------------------------
    def _local_peers(self, placement: Placement) -> Optional[List[Tuple[int, List[int], torch.Tensor]]]:
        """(EP rank, rows per EP rank [ep], send order on the host) of every rank whose rows `up`
        returns: this rank alone, or with S2 its TP group. From this rank's placement where the
        TP group lies in its ep_esp group (one placement for all); None where it spans several
        (`_peers` exchanges them)."""
        state, tp = self.state, self.state.tp
        ranks = [state.ep_esp.rank] if self.piece_rows is None or tp.size == 1 else None
        if ranks is None and set(tp.ranks) <= set(state.ep_esp.ranks):
            ranks = [state.ep_esp.ranks.index(r) for r in tp.ranks]
        if ranks is None:
            return None
        return [(source // state.esp_size, placement.send_splits(source),
                 torch.argsort(placement.destinations(source), stable=True)) for source in ranks]

    def _peers(self, device) -> List[Tuple[int, List[int], torch.Tensor]]:
        """`_local_peers` where the TP group spans several ep_esp groups (placements differ per
        ep_esp group): exchanged over tp, the rows per EP rank read on the host (a host sync)."""
        tp, ep = self.state.tp, len(self.per_ep)
        local = torch.cat([upload([torch.tensor(self.per_ep, dtype=torch.long)], device)[0], self.send_order])
        gathered = C.all_gather_v(local, tp, [ep + n for n in self.piece_rows], kind=ROUTING_KIND)
        metas = gathered.split([ep + n for n in self.piece_rows])
        splits = to_host(torch.stack([meta[:ep] for meta in metas]), "saa peers").tolist()  # [tp][ep]
        return [(self.state.layout.coords(rank)["ep"], rows, meta[ep:])
                for rank, rows, meta in zip(tp.ranks, splits, metas)]

    def _phased_up(self, out: torch.Tensor, in_flight: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """SAA (Fig. 5): phase i receives EP rank (p - i)'s shards' partial sums, combines them and
        all-gathers them on tp while phase i + 1's point-to-point exchange runs."""
        state, hidden = self.state, out.shape[1]
        ep_esp, esp, ep, p = state.ep_esp, state.esp_size, state.ep_size, state.ep.rank
        blocks = out.split(self.recv_splits)  # partial sums for each source
        gathers = []
        for phase in range(ep):
            to, frm = (p + phase) % ep, (p - phase) % ep
            sends = [(to * esp + j, blocks[to * esp + j]) for j in range(esp) if to * esp + j != ep_esp.rank]
            parts = [blocks[ep_esp.rank] if frm * esp + j == ep_esp.rank else out.new_empty((self.per_ep[frm], hidden))
                     for j in range(esp)]
            recvs = [(frm * esp + j, parts[j]) for j in range(esp) if frm * esp + j != ep_esp.rank]
            handle = C.p2p_exchange(sends, recvs, ep_esp, kind=SAA_KIND)
            if phase == 0 and in_flight is not None:
                in_flight()
            handle.wait()
            combined = reduce(add, parts)  # local combine [rows for EP rank frm, h]
            sizes = [per_ep[(q - phase) % ep] for q, per_ep, _ in self.peers]
            gathers.append((C.all_gather_v_async(combined, state.tp, sizes) if len(self.peers) > 1
                            else C.Pending.completed(lambda c=combined: c), sizes))
        by_phase = [g.wait().split(sizes) for g, sizes in gathers]  # [phase][peer] block
        pieces = []
        for t, (q_t, _, send_order) in enumerate(self.peers):
            in_send_order = torch.cat([by_phase[(q_t - q) % ep][t] for q in range(ep)])
            pieces.append(torch.empty_like(in_send_order).index_copy_(0, send_order, in_send_order))
        return torch.cat(pieces)


class _Exchange(torch.autograd.Function):
    """EP&ESP-AlltoAll as autograd: `down` (dispatch) and `up` (combine) are each other's backward."""

    @staticmethod
    def forward(ctx, x, exchange: EpEspExchange, direction: str):
        ctx.exchange, ctx.direction = exchange, direction
        if direction == "down":
            return exchange.down(x)
        combining, exchange.combining = exchange.combining, None
        return exchange.up(x, combining)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        fill = ctx.exchange.backward_fill
        in_flight = (lambda: fill(grad.numel())) if fill is not None else None
        return (ctx.exchange.up(grad, in_flight) if ctx.direction == "down" else ctx.exchange.down(grad, in_flight)), \
            None, None


class ParmSchedule(Schedule):
    """What S1, S2 and auto share: counts, dispatch, combine and statistics."""

    expert_grad_scale = 1.0  # PauseMP: no token is computed twice

    def source_ep_ranks(self) -> List[int]:
        return [source // self.state.esp_size for source in range(self.state.ep_esp.size)]

    def _gather_counts(self, local: torch.Tensor, kept: Optional[torch.Tensor] = None):
        """local [..., E] (ours) -> Long[ep*esp, ..., E] on the host: every ep_esp source's counts;
        with `kept` (Long[E] on the device) also its host copy, read with them: one host read."""
        gathered = C.all_gather(local.reshape(1, -1), self.state.ep_esp, kind=COUNTS_KIND)
        gathered = gathered.view((-1,) + tuple(local.shape))
        if kept is None:
            return to_host(gathered, "counts")
        return tuple(to_host_all([gathered, kept], "counts"))

    def _token_split(self, router: Router, routing: Routing, tokens: torch.Tensor, sizes: List[int],
                     counts: torch.Tensor) -> ParmRouted:
        """S1 from this TP rank's routed tokens; `counts` Long[S, E] (host) of every source's piece."""
        slots = _kept_slots(routing.expert_ids, routing.kept, int(counts[self.state.ep_esp.rank].sum()))
        return ParmRouted(routing, counts, "s1", tokens, routing.weights, slots, None, sizes,
                          routing.dropped_of_counts())

    def _expert_split(self, router: Router, routing: Routing, x: torch.Tensor,
                      counts: Optional[torch.Tensor] = None, kept_host: Optional[torch.Tensor] = None) -> ParmRouted:
        """S2 step 2 from the whole micro-batch's routing: chunk t of every expert's assignments.
        `counts` (every source's chunk counts, host) and `kept_host` (the micro-batch's kept
        assignments per expert, host) are read here unless given (one host read)."""
        tp = self.state.tp
        kept = kept_counts(routing.expert_ids, routing.kept, router.num_experts)  # [E] on the device
        chunks = _expert_chunks(kept, tp.size)  # [tp, E] on the device
        if counts is None:
            counts, kept_host = self._gather_counts(chunks[tp.rank], kept)
        kept_host = kept_host.tolist()
        m = sum(kept_host)
        piece_rows = [sum(c // tp.size + (t < c % tp.size) for c in kept_host) for t in range(tp.size)]  # chunks' rows
        slots = _kept_slots(routing.expert_ids, routing.kept, m)
        starts = _exclusive_cumsum(kept) + torch.cumsum(chunks, 0) - chunks  # [tp, E] in `slots`
        slots = slots[_block_index(starts.flatten(), chunks.flatten(), m)]  # TP pieces, experts ascending
        return ParmRouted(routing, counts, "s2", x, routing.weights, slots, piece_rows, None,
                          routing.dropped_of_counts())

    def uses_saa(self, routed: ParmRouted) -> bool:
        """SAA is S2's combine (§III-D); S1 has no MP-AllGather of expert outputs to overlap."""
        return self.cfg.moe.saa and routed.choice == "s2"

    def parm_routed(self, routed) -> ParmRouted:
        """The S1 / S2 routing this forward runs (auto: the one `place` chose)."""
        return routed

    def _rows(self, routed: ParmRouted) -> torch.Tensor:
        """[m, h] the kept assignments' rows of `routed.tokens`, in `routed.slots` order."""
        return routed.tokens.index_select(0, routed.slots // routed.weights.shape[1])

    def dispatch(self, routed, placement: Placement) -> Tuple[ExpertBatch, Tuple]:
        routed = self.parm_routed(routed)
        exchange = EpEspExchange(self.state, placement, routed.piece_rows, self.uses_saa(routed), routed.tokens.device)
        exchange.in_flight, exchange.backward_fill = self.hooks.in_flight(), self.backward_fill()
        p = self.state.ep.rank
        batch = ExpertBatch(_Exchange.apply(self._rows(routed), exchange, "down"), placement.experts_on(p),
                            placement.expert_counts(p), exchange.expert_counts)
        return batch, (routed, exchange)

    def combine(self, expert_output: torch.Tensor, ctx: Tuple[ParmRouted, EpEspExchange]) -> torch.Tensor:
        routed, exchange = ctx
        exchange.combining = self.hooks.combining()
        return self._finish(_Exchange.apply(expert_output, exchange, "up"), routed)  # rows aligned with slots

    def _finish(self, rows: torch.Tensor, routed: ParmRouted) -> torch.Tensor:
        """Rows [m, h] aligned with `routed.slots` -> gate-weighted combine (+ S1's MP-AllGather) [n, h]."""
        y = self.weighted_sum(rows, routed.weights, routed.slots, routed.tokens.shape[0])
        if routed.choice == "s1":  # MP-AllGather of the own tokens' outputs
            y = C.all_gather_v_autograd(y, self.state.tp, routed.token_sizes, backward="split")
        return y  # [n, h]

    def smart_parts(self, routed, placement: Placement):
        """Pairwise steps over `ep_esp`, an EP rank's shard holders in one fine-grained group; S2's
        MP-Split / MP-AllGather and the local Dump / Combine stay outside (plain autograd)."""
        from megatron_moe.techniques.fastermoe.smart import SmartPlan, smart_peer_group

        routed, state = self.parm_routed(routed), self.state
        exchange = EpEspExchange(state, placement, routed.piece_rows, False, routed.tokens.device)
        rows = self._rows(routed)
        if routed.piece_rows is not None:  # S2's MP-Split (backward: all-gather of the pieces' gradients)
            rows = C.split_v_autograd(rows, state.tp, routed.piece_rows)
        peers = smart_peer_group(self.cfg.moe.smart_group_size, state.esp_size, exchange_over_ep_esp=True)
        plan = SmartPlan(state.ep_esp, exchange.send_splits, exchange.recv_splits, peers, placement, state.ep.rank)
        return rows.index_select(0, exchange.dump), (routed, exchange, rows.shape), plan, lambda out: out

    def smart_finish(self, returned: torch.Tensor, ctx) -> torch.Tensor:
        routed, exchange, shape = ctx
        rows = returned.new_zeros(shape).index_add(0, exchange.dump, returned)  # local Combine of the N_ESP partials
        if routed.piece_rows is not None:  # S2's MP-AllGather, used alike on every TP rank
            rows = C.all_gather_v_autograd(rows, self.state.tp, routed.piece_rows, backward="split")
        return self._finish(rows, routed)

    def stats(self, routed, placement: Placement) -> MoEStats:
        routed = self.parm_routed(routed)
        return MoEStats(routed.routing.tokens_per_expert, routed.dropped, placement.tokens_per_ep_rank(), routed.choice,
                        placement.num_replicas)


def _expert_chunks(kept: torch.Tensor, parts: int) -> torch.Tensor:
    """S2's MP-Split: kept assignments per expert Long[E] -> Long[parts, E], expert e's m_e
    assignments dealt in contiguous chunks (m_e / parts each, the first m_e % parts parts one more)."""
    ranks = torch.arange(parts, device=kept.device).unsqueeze(1)
    return kept // parts + (ranks < kept % parts).long()


def _tp_piece(state: ParallelState, num_tokens: int) -> Tuple[List[int], int, int]:
    """S1's MP-Split of `num_tokens` tokens: (sizes per TP rank, this rank's start, end)."""
    sizes = even_split(num_tokens, state.tp_size)
    start = sum(sizes[: state.tp.rank])
    return sizes, start, start + sizes[state.tp.rank]


@SCHEDULES.register("s1")
class S1(ParmSchedule):
    def route(self, router: Router, x: torch.Tensor) -> ParmRouted:
        sizes, _, _ = _tp_piece(self.state, x.shape[0])
        piece = C.split_v_autograd(x, self.state.tp, sizes)  # MP-Split [n_t, h]
        routing = _route_tp_piece(router, piece, x.shape[0], self.state.tp)
        local = kept_counts(routing.expert_ids, routing.kept, router.num_experts)
        return self._token_split(router, routing, piece, sizes, self._gather_counts(local))


@SCHEDULES.register("s2")
class S2(ParmSchedule):
    def route(self, router: Router, x: torch.Tensor) -> ParmRouted:
        return self._expert_split(router, router(x), x)


@dataclass
class AutoRouted(Routed):
    """auto's route: the whole micro-batch's routing and both candidates' counts; `place` picks."""

    router: Router
    x: torch.Tensor  # [n, h] the replicated micro-batch
    counts_s1: torch.Tensor  # Long[S, E] every source's S1 token-piece counts (`counts`: S2's chunks)
    kept: torch.Tensor  # Long[E] on the host: the micro-batch's kept assignments per expert
    chosen: Optional[ParmRouted] = None  # set by `place`


@SCHEDULES.register("auto")
class Auto(ParmSchedule):
    """Alg. 1 per layer and forward: route -> plan both candidates -> choose (module docstring)."""

    def __init__(self, cfg, state):
        super().__init__(cfg, state)
        self.profile = configured_profile(cfg, PARM_OPS, "moe.schedule=auto")
        # a TP group spanning several ep_esp groups must max-reduce the estimates (validate.py
        # refuses layouts where neither of tensor and expert * expert_shard divides the other)
        self.reduce_over_tp = state.tp_size > state.ep_esp.size

    def route(self, router: Router, x: torch.Tensor) -> AutoRouted:
        routing = router(x)  # replicated over tp: every TP rank knows every candidate's counts
        _, start, end = _tp_piece(self.state, x.shape[0])
        kept = kept_counts(routing.expert_ids, routing.kept, router.num_experts)  # [E]
        s1 = kept_counts(routing.expert_ids[start:end], routing.kept[start:end], router.num_experts)
        s2 = _expert_chunks(kept, self.state.tp_size)[self.state.tp.rank]
        counts, kept = self._gather_counts(torch.stack([s1, s2]), kept)  # [S, 2, E], [E]: one host read
        return AutoRouted(routing, counts[:, 1], router, x, counts[:, 0], kept)

    def place(self, routed: AutoRouted, balancer) -> Placement:
        sources = self.source_ep_ranks()
        placements = {"s1": balancer.plan(routed.counts_s1, sources), "s2": balancer.plan(routed.counts, sources)}
        choice = self._choose(routed.x, placements)
        routing, x, router, state = routed.routing, routed.x, routed.router, self.state
        if choice == "s2":
            routed.chosen = self._expert_split(router, routing, x, routed.counts, routed.kept)
        else:
            sizes, start, end = _tp_piece(state, x.shape[0])
            piece = Routing(routing.expert_ids[start:end], C.split_v_autograd(routing.weights, state.tp, sizes),
                            routing.kept[start:end], routing.tokens_per_expert, routing.aux_loss, routing.capacity,
                            routing.prior_counts)
            routed.chosen = self._token_split(router, piece, C.split_v_autograd(x, state.tp, sizes), sizes,
                                              routed.counts_s1)
        return placements[choice]

    def _choose(self, x: torch.Tensor, placements) -> str:
        state = self.state
        assignments = torch.tensor([dispatched_assignments(placements[c].tokens_per_ep_rank(), state.tp_size,
                                                           state.esp_size) for c in ("s1", "s2")], dtype=torch.float64)
        if self.reduce_over_tp:  # [2] on tp's device (NCCL: the GPU), back to the host for the pick
            assignments = to_host(C.all_reduce(state.tp.to_device(assignments), state.tp, op="max", kind=CHOICE_KIND),
                                  "auto choice")
        return choose_schedule(self.profile, x.shape[0], x.shape[1], float(assignments[0]), state.tp_size,
                               state.esp_size, self.cfg.moe.saa, assignments_s2=float(assignments[1]))

    def parm_routed(self, routed: AutoRouted) -> ParmRouted:
        return routed.chosen


@section_check("parm")
def _check_parm(cfg, world_size: int) -> None:
    """SAA belongs to S2 with an MP group (auto picks S1 when parallel.tensor=1, so auto + SAA never
    runs SAA there); auto's pick must agree over TP and ep_esp groups."""
    moe, par = cfg.moe, cfg.parallel
    if moe.saa and moe.schedule not in ("s2", "auto"):
        raise ConfigError(f"moe.saa=true needs moe.schedule s2 or auto, not {moe.schedule!r}")
    if moe.saa and moe.schedule == "s2" and par.tensor == 1:
        raise ConfigError("moe.saa=true with moe.schedule=s2 needs parallel.tensor > 1: SAA overlaps S2's second "
                          "EP&ESP-AlltoAll with its MP-AllGather, and with parallel.tensor=1 there is no all-gather "
                          "(its N_EP phases would be pure overhead); set moe.saa=false")
    ep_esp = par.expert * par.expert_shard
    if moe.schedule == "auto" and par.tensor % ep_esp and ep_esp % par.tensor:
        # ranks sharing a TP group or an ep_esp group must pick alike (see Auto above)
        raise ConfigError(f"moe.schedule=auto needs parallel.tensor={par.tensor} and parallel.expert*"
                          f"parallel.expert_shard={ep_esp} to divide one another")


@PROFILE_NEEDS.register("parm")
def _profile_needs(cfg) -> list:
    return [(PARM_OPS, "moe.schedule=auto")] if cfg.moe.schedule == "auto" else []

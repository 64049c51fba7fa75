"""DeepSeek's Expert Parallelism Load Balancer (EPLB) as a pure numpy plan (issue 11).

Reference: deepseek-ai/EPLB, `eplb.py` (https://github.com/deepseek-ai/EPLB), the redundant-experts
strategy of DeepSeek-V3 (arXiv:2412.19437 §3.4). Written from scratch after reading it:

    replicate_experts  start at one replica per expert; each extra slot goes to the expert with
                       the highest load per replica
    balanced_packing   heaviest item first, into the lightest pack that still has room
    rebalance          flat: replicate over all slots, pack the replicas onto ranks;
                       hierarchical (`ranks_per_node`, DeepSeek's `rebalance_experts_hierarchical`):
                       pack the router's expert groups onto nodes (step 1), then plan each node
                       flat over its own ranks (steps 2-3: replicate within the node, pack the
                       replicas onto its ranks), so a group's experts and every replica of them
                       stay in one node

Differences from DeepSeek's code, all deliberate:
  * two replicas of one expert never share a rank (DeepSeek's packing allows it, which only adds a
    second copy of the same weights): replica counts are capped at the number of ranks, packing
    skips packs that already hold the item's expert, and a swap repairs the rare dead end;
  * without router groups (`groups` = 1) the hierarchical plan packs single experts onto nodes,
    as DeepSeek's does when given E groups of one expert (given one group, its entry point plans
    globally); router groups that do not divide evenly over the nodes are refused (DeepSeek's
    entry point falls back to the global plan);
  * one layer at a time, and the plan is returned as `slot_to_expert` [ranks, slots_per_rank]
    (slots of a rank sorted by expert id) with the replica count of every expert.
"""
from __future__ import annotations

from typing import List, Optional, Set, Tuple

import numpy as np


def _check_load(load: np.ndarray) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 1 or load.size == 0:
        raise ValueError(f"load must be a non-empty 1-D array of per-expert loads, got shape {load.shape}")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("load must be finite and non-negative")
    return load


def replicate_experts(load: np.ndarray, slots: int, max_replicas: Optional[int] = None) -> np.ndarray:
    """load [E] -> replica count Int[E] summing to `slots`: one replica each, then every extra slot
    to the expert with the highest load per replica (ties: lower expert id), never past
    `max_replicas` replicas of one expert (unbounded when None)."""
    load = _check_load(load)
    num_experts = load.size
    cap = slots if max_replicas is None else max_replicas
    if slots < num_experts:
        raise ValueError(f"{slots} slots cannot give each of the {num_experts} experts a replica")
    if slots > num_experts * cap:
        raise ValueError(f"{slots} slots exceed {num_experts} experts x {cap} replicas at most")
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(slots - num_experts):
        per_replica = np.where(counts < cap, load / counts, -np.inf)
        counts[int(np.argmax(per_replica))] += 1  # argmax: first maximum, the lower expert id
    return counts


def balanced_packing(weights: np.ndarray, packs: int, capacity: int,
                     labels: Optional[np.ndarray] = None) -> np.ndarray:
    """weights [n] -> pack index Int[n], each pack holding exactly `capacity` = n / packs items:
    items by descending weight (ties: lower index) go to the lightest pack with room (ties: lower
    pack). With `labels` [n], items sharing a label never share a pack: an item skips the packs that
    hold its label, and when every pack with room does, `_make_room` swaps one item out."""
    weights = np.asarray(weights, dtype=np.float64)
    n = weights.size
    if packs < 1 or capacity < 1 or n != packs * capacity:
        raise ValueError(f"{n} items do not fill {packs} packs of {capacity} items exactly")
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != weights.shape:
            raise ValueError(f"labels shape {labels.shape} != weights shape {weights.shape}")
        if np.unique(labels, return_counts=True)[1].max() > packs:
            raise ValueError(f"a label has more than {packs} items: they cannot all sit in different packs")
    pack_of = np.full(n, -1, dtype=np.int64)
    load = np.zeros(packs)
    members: List[List[int]] = [[] for _ in range(packs)]
    held: List[Set] = [set() for _ in range(packs)]
    for item in np.argsort(-weights, kind="stable").tolist():
        label = None if labels is None else labels[item]
        open_packs = [p for p in range(packs) if len(members[p]) < capacity]
        allowed = [p for p in open_packs if label is None or label not in held[p]]
        if allowed:
            pack = min(allowed, key=lambda p: load[p])  # min keeps the first, the lower pack, on ties
        else:
            pack = _make_room(min(open_packs, key=lambda p: load[p]), label, weights, labels,
                              pack_of, load, members, held)
        pack_of[item] = pack
        load[pack] += weights[item]
        members[pack].append(item)
        if label is not None:
            held[pack].add(label)
    return pack_of


def _make_room(open_pack: int, label, weights: np.ndarray, labels: np.ndarray, pack_of: np.ndarray,
               load: np.ndarray, members: List[List[int]], held: List[Set]) -> int:
    """Every pack with room holds `label`: move an item j from a full pack q without `label` into
    `open_pack` (j's label not there) and return q for the item to place. Such j exists when no
    label has more items than packs (q holds `capacity` distinct labels, `open_pack` fewer than
    `capacity` - 1 besides `label`). Picks the move with the lightest heavier pack afterwards."""
    candidates = [(max(load[open_pack] + weights[j], load[q] - weights[j]), q, j)
                  for q in range(len(members)) if label not in held[q]
                  for j in members[q] if labels[j] not in held[open_pack]]
    _, q, j = min(candidates)
    members[q].remove(j)
    held[q].discard(labels[j])
    load[q] -= weights[j]
    pack_of[j] = open_pack
    members[open_pack].append(j)
    held[open_pack].add(labels[j])
    load[open_pack] += weights[j]
    return q


def _check_shape(num_experts: int, num_ranks: int, slots_per_rank: int, scope: str) -> None:
    if num_ranks * slots_per_rank < num_experts:
        raise ValueError(f"{num_ranks} ranks x {slots_per_rank} slots{scope} cannot hold "
                         f"{num_experts} experts (slots < E)")
    if slots_per_rank > num_experts:
        raise ValueError(f"{slots_per_rank} slots per rank > {num_experts} experts{scope}: a rank "
                         "would hold two replicas of one expert")


def _rebalance_flat(load: np.ndarray, num_ranks: int, slots_per_rank: int) -> Tuple[np.ndarray, np.ndarray]:
    counts = replicate_experts(load, num_ranks * slots_per_rank, max_replicas=num_ranks)
    expert = np.repeat(np.arange(load.size), counts)  # [slots] expert of each replica
    rank = balanced_packing(load[expert] / counts[expert], num_ranks, slots_per_rank, labels=expert)
    order = np.lexsort((expert, rank))  # by rank, then expert id within a rank
    return expert[order].reshape(num_ranks, slots_per_rank), counts


def rebalance(load: np.ndarray, num_ranks: int, slots_per_rank: int,
              ranks_per_node: Optional[int] = None, groups: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """load [E] -> (slot_to_expert Int[num_ranks, slots_per_rank], replica_count Int[E]).

    Flat: replicate over all num_ranks * slots_per_rank slots (at most one replica per rank), then
    pack the replicas (weight load[e] / replica_count[e]) onto ranks. Hierarchical when
    `ranks_per_node` is given: pack the `groups` contiguous expert groups of group-limited routing
    (`moe.router_groups`; E / groups experts each) onto nodes by their summed load, groups / nodes
    per node (`groups` = 1: the single experts, E / nodes per node), then plan each node flat over
    its ranks; every expert of a group, and every replica of it, lives in the group's node.
    `groups` is ignored by the flat plan."""
    load = _check_load(load)
    num_experts = load.size
    if num_ranks < 1 or slots_per_rank < 1:
        raise ValueError(f"num_ranks ({num_ranks}) and slots_per_rank ({slots_per_rank}) must be >= 1")
    if ranks_per_node is None:
        _check_shape(num_experts, num_ranks, slots_per_rank, "")
        return _rebalance_flat(load, num_ranks, slots_per_rank)
    if ranks_per_node < 1 or num_ranks % ranks_per_node:
        raise ValueError(f"num_ranks ({num_ranks}) must be a positive multiple of ranks_per_node ({ranks_per_node})")
    nodes = num_ranks // ranks_per_node
    if num_experts % nodes:
        raise ValueError(f"{num_experts} experts are not divisible by {nodes} nodes")
    _check_shape(num_experts // nodes, ranks_per_node, slots_per_rank, " per node")
    node_of = _nodes_of_experts(load, nodes, groups)
    slot_to_expert = np.empty((num_ranks, slots_per_rank), dtype=np.int64)
    counts = np.empty(num_experts, dtype=np.int64)
    for node in range(nodes):
        experts = np.flatnonzero(node_of == node)  # [E / nodes] global ids, ascending
        local, counts[experts] = _rebalance_flat(load[experts], ranks_per_node, slots_per_rank)
        slot_to_expert[node * ranks_per_node:(node + 1) * ranks_per_node] = experts[local]
    return slot_to_expert, counts


def _nodes_of_experts(load: np.ndarray, nodes: int, groups: int) -> np.ndarray:
    """Int[E]: the node of each expert. DeepSeek's step 1: the `groups` contiguous groups, weighed
    by their summed load, packed onto `nodes` nodes (groups / nodes each) by `balanced_packing`;
    groups = 1 packs the single experts instead."""
    num_experts = load.size
    if groups == 1:
        return balanced_packing(load, nodes, num_experts // nodes)
    if groups < 1 or num_experts % groups:
        raise ValueError(f"{groups} router groups do not divide {num_experts} experts")
    if groups % nodes:
        raise ValueError(f"{groups} router groups do not divide evenly over {nodes} nodes")
    group_node = balanced_packing(load.reshape(groups, -1).sum(axis=1), nodes, groups // nodes)
    return np.repeat(group_node, num_experts // groups)


def rank_loads(load: np.ndarray, slot_to_expert: np.ndarray, replica_count: np.ndarray) -> np.ndarray:
    """Float[ranks]: sum over each rank's slots of load[e] / replica_count[e]."""
    load = _check_load(load)
    slot_to_expert = np.asarray(slot_to_expert)
    replica_count = np.asarray(replica_count)
    if not np.array_equal(np.bincount(slot_to_expert.ravel(), minlength=load.size), replica_count):
        raise ValueError("replica_count does not match the replicas in slot_to_expert")
    if np.any(replica_count < 1):
        raise ValueError("every expert needs at least one replica")
    return (load / replica_count)[slot_to_expert].sum(axis=1)


def max_rank_load(load: np.ndarray, slot_to_expert: np.ndarray, replica_count: np.ndarray) -> float:
    """The heaviest rank's load (the quantity EPLB minimizes)."""
    return float(rank_loads(load, slot_to_expert, replica_count).max())


def balance_ratio(load: np.ndarray, slot_to_expert: np.ndarray, replica_count: np.ndarray) -> float:
    """max / mean rank load: 1.0 when perfectly balanced (and for an all-zero load)."""
    loads = rank_loads(load, slot_to_expert, replica_count)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0

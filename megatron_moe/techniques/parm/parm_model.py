"""Parm's automatic choice between S1 and S2 (§V, Eq. 12-14, Alg. 1).

With an alpha-beta profile (`perf/hardware.py`), for one data-parallel micro-batch of B L tokens of
M elements, E T token-expert assignments dispatched, N_MP-way MP and N_ESP-way ESP:

    x   = E T M N_ESP / N_MP                     elements each rank feeds each EP&ESP-AlltoAll
    t_D1 = 2 A2A_EP&ESP(x) + AG_MP(B L M)        Eq. 11 / 13, Alg. 1 line 4
    t_D2 =   A2A_EP&ESP(x) + Overlap(x)          Eq. 7, Alg. 1 line 5 (S2 with SAA)
    t_D2 = 2 A2A_EP&ESP(x) + AG_MP(E T M)        Eq. 7's right-hand side (S2 with AAS, moe.saa false)
    S1 if t_D1 <= t_D2 else S2                   Alg. 1 lines 6-9

Conventions where the paper is loose (written down, DESIGN.md §5's spirit):

* Overlap(x) is the measured time of S2's second EP&ESP-AlltoAll (input x per rank) run together
  with its MP-AllGather of the E T M combined rows (SAA, §III-D); the MP-AllGather that Eq. 14
  adds separately is inside it (Eq. 7 and Alg. 1 agree). Its beta is per element of x, the same
  argument as the all-to-all (Alg. 1 writes beta_o * y with y = N_MP x: a rescaled beta_o).
* Alg. 1 line 2 reads T = k f B L M / E; the M is a typo (y multiplies by M again): T = k f B L / E.
* N_MP = 1: there is no MP group, S1 and S2 move the same data (Eq. 2) and S1 is returned.
* Online (dropless or capacity): E T is measured per candidate from the Placement the balancer
  made for it, as the all-to-all's bottleneck: the rows of the busiest EP rank, scaled to one
  micro-batch (`dispatched_assignments`); with balanced routing this is Alg. 1's E T = k f B L.
  S1 and S2 deal a micro-batch's rows to different sources, so each candidate has its own
  placement and its own E T (t_D1 from S1's, t_D2 from S2's).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_moe.perf.hardware import HardwareProfile


def schedule_times(profile: HardwareProfile, tokens: int, hidden: int, assignments: float, n_mp: int,
                   n_esp: int, saa: bool = True) -> Tuple[float, float]:
    """(t_D1, t_D2) in seconds: `tokens` = B L, `hidden` = M, `assignments` = E T; S2 with SAA or AAS."""
    x = assignments * hidden * n_esp / n_mp
    a2a = profile.ep_esp_alltoall.time(x)
    t_d2 = a2a + profile.saa.time(x) if saa else 2 * a2a + profile.mp_allgather.time(assignments * hidden)
    return 2 * a2a + profile.mp_allgather.time(tokens * hidden), t_d2


def choose_schedule(profile: HardwareProfile, tokens: int, hidden: int, assignments: float, n_mp: int,
                    n_esp: int, saa: bool = True, assignments_s2: Optional[float] = None) -> str:
    """Alg. 1: "s1" or "s2". `assignments_s2`: S2's own E T when it differs from S1's (online)."""
    if n_mp == 1:
        return "s1"
    t_d1, _ = schedule_times(profile, tokens, hidden, assignments, n_mp, n_esp, saa)
    _, t_d2 = schedule_times(profile, tokens, hidden, assignments if assignments_s2 is None else assignments_s2,
                             n_mp, n_esp, saa)
    return "s1" if t_d1 <= t_d2 else "s2"


def capacity_assignments(tokens: int, top_k: int, capacity_factor: float) -> float:
    """Alg. 1 line 2 times E: E T = k f B L."""
    return top_k * capacity_factor * tokens


def dispatched_assignments(rows_per_ep_rank: torch.Tensor, n_mp: int, n_esp: int) -> float:
    """E T of one micro-batch from a Placement's rows per EP rank (`tokens_per_ep_rank()`, Long[N_EP])
    over one `ep_esp` group: N_EP x the busiest rank's rows per micro-batch. The group's N_EP N_ESP
    sources each hold 1/N_MP of a micro-batch (S1 and S2), i.e. N_EP N_ESP / N_MP micro-batches,
    so E T = max rows x N_MP / N_ESP; balanced, E T = the kept assignments of a micro-batch."""
    return float(rows_per_ep_rank.max()) * n_mp / n_esp

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
* Online (dropless or capacity): E T is measured from the routed micro-batch as the all-to-all's
  bottleneck, N_EP times the kept assignments of the busiest EP rank (`dispatched_assignments`);
  with balanced routing this is Alg. 1's E T = k f B L.
"""
from __future__ import annotations

from typing import Tuple

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
                    n_esp: int, saa: bool = True) -> str:
    """Alg. 1: "s1" or "s2"."""
    if n_mp == 1:
        return "s1"
    t_d1, t_d2 = schedule_times(profile, tokens, hidden, assignments, n_mp, n_esp, saa)
    return "s1" if t_d1 <= t_d2 else "s2"


def capacity_assignments(tokens: int, top_k: int, capacity_factor: float) -> float:
    """Alg. 1 line 2 times E: E T = k f B L."""
    return top_k * capacity_factor * tokens


def dispatched_assignments(kept_per_expert: torch.Tensor, ep_size: int) -> int:
    """E T of a routed micro-batch: N_EP x the kept assignments of its busiest EP rank (experts
    are owned contiguously, E / N_EP per rank). kept_per_expert: Long[E]."""
    return ep_size * int(kept_per_expert.view(ep_size, -1).sum(1).max())

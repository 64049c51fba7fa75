"""Pro-Prophet's performance model of an MoE layer under a lightweight expert placement
(Wang et al., "Pro-Prophet", §IV-B Eq. 1-6, §V-C Eq. 8).

With D devices (EP ranks), R_i the rows device i receives from other devices, H_i the rows it
computes, s selected experts each moved to some devices:

    T_A2A(R)     = max_i R_i size(input) / B                                  Eq. 1
    T_FEC(H)     = max_i H_i / t                                               Eq. 2
    T_BEC(H)     = 2 max_i H_i / t                                             Eq. 3
    T_Trans      = sum_e k_e size(e.params) / (D B)                            Eq. 4
    T_Agg        = sum_e k_e size(e.grads)  / (D B)                            Eq. 5
    T'           = 4 T_A2A + 3 T_FEC + T_Trans + T_Agg                         Eq. 6
    T' (overlap) = 4 T_A2A + 3 T_FEC + T_PTrans + T_PAgg                       Eq. 8
        T_PTrans = max(0, T_Trans - T_FEC - T_FNEC),  T_PAgg = max(0, T_Agg - T_BEC - T_BNEC)

Eq. 4-5 print s (D - n): s experts, each sent to the D - n devices Alg. 1 did not exclude. A
lightweight placement here chooses each expert's devices separately (Alg. 1 also skips devices
with no rows of the expert, as the paper's Fig. 6b does), so s (D - n) becomes sum_e k_e with k_e
the devices expert e is actually sent to (its replicas other than the owner); the two agree when
every selected expert goes to D - n - 1 other devices.

Units from the hardware profile (`perf/hardware.py`): 1 / B is `p2p.beta` (seconds per element
between two ranks; Tutel's all-to-all is point to point, §IV-B), 1 / t is the time of one row
through one expert shard, `expert_compute.beta` x F (F FLOPs per row), size(input) = h elements,
size(e.params) = Q elements of one expert shard. T_FNEC, the forward time of the non-MoE part of a
block (constant during training, §V-B), is estimated from its FLOPs at the same throughput;
T_BNEC = 2 T_FNEC. The profile's latency terms (alpha) are not in the paper's model and are left
out, so predictions are bandwidth-only as printed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_moe.perf.hardware import HardwareProfile

PROPROPHET_OPS = ("p2p", "expert_compute")


@dataclass(frozen=True)
class ProphetCostModel:
    row_elements: int  # size(input): h
    params_per_expert: float  # size(e.params) = size(e.grads): Q elements of one expert shard
    seconds_per_row: float  # 1 / t: one row through one expert shard, forward
    seconds_per_element: float  # 1 / B: p2p
    fnec_seconds: float  # T_FNEC of one block (forward, non-MoE part)
    overlap: bool = False  # Eq. 8 (block-wise scheduler) instead of Eq. 6

    @classmethod
    def from_profile(cls, profile: HardwareProfile, row_elements: int, params_per_expert: float,
                     flops_per_row: float, fnec_flops: float, overlap: bool) -> "ProphetCostModel":
        profile.require(PROPROPHET_OPS, "moe.balancer=proprophet")
        flop = profile.expert_compute.beta
        return cls(row_elements, params_per_expert, flops_per_row * flop, profile.p2p.beta, fnec_flops * flop, overlap)

    def a2a(self, received: np.ndarray) -> float:
        """Eq. 1: received [D] rows from other devices."""
        return float(received.max()) * self.row_elements * self.seconds_per_element

    def fec(self, computed: np.ndarray) -> float:
        """Eq. 2 (Eq. 3 is twice it): computed [D] rows."""
        return float(computed.max()) * self.seconds_per_row

    def trans(self, transfers: int, devices: int) -> float:
        """Eq. 4 (= Eq. 5, gradients are as large as parameters): `transfers` = sum_e k_e."""
        return transfers * self.params_per_expert * self.seconds_per_element / devices

    def layer(self, computed: np.ndarray, received: np.ndarray, transfers: int) -> float:
        """T' of Eq. 6, or of Eq. 8 with `overlap`."""
        fec, moved = self.fec(computed), self.trans(transfers, len(computed))
        if self.overlap:
            trans = max(0.0, moved - fec - self.fnec_seconds)
            agg = max(0.0, moved - 2 * fec - 2 * self.fnec_seconds)
        else:
            trans = agg = moved
        return 4 * self.a2a(received) + 3 * fec + trans + agg

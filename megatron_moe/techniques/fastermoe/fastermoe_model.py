"""FasterMoE's performance model of dynamic shadowing (He et al., PPoPP'22, §4.1, Eq. 7-10).

Per MoE layer and iteration, with B_w the rows EP rank w computes (each of its ESP shards
computes all of them), P the compute throughput, W_net the network bandwidth:

    Lat_imbl(B)       = max_w { 3 F B_w / P + 4 B_w H / W_net }         Eq. 7 (1 GEMM pass forward, 2 backward;
                                                                         2 all-to-alls each way)
    Lat_shadow(r, B') = max_w { 3 F B'_w / P [+ 4 B'_w H / W_net] } + 2 r Q / W_net
                                                                         Eq. 8 (broadcast + reduce of r experts)

F = FLOPs of one row through one expert shard forward (4 alpha H^2 in the paper's GeLU MLP; here
2 h (W + f) / N_ESP for any activation), Q = elements of one expert shard's parameters (2 alpha
H^2), H = hidden size (elements per token row). Times come from the hardware profile
(`perf/hardware.py`): 1 / P is `expert_compute.beta` (s per FLOP), the token rows' 1 / W_net
`p2p.beta` (s per element between two ranks), the shadowed parameters' `broadcast.beta` (s per
element broadcast over `ep`, the collective shadowing uses).

`moe.fastermoe.eq8` names the variant (`ShadowCostModel.eq8`):

    printed     (default) Eq. 8 as printed: no token term once anything is shadowed, 2 r Q / W_net
    token_term  the bracketed term kept, at the new loads B'_w: shadowing pays only when it cuts the
                busiest rank's load by enough to move the weights. B'_w counts the rows a rank
                computes from its own sources for shadowed experts, though they never cross the
                network, so this overcharges the shadowed case (no paper or release uses it)
    fastmoe     FastMoE's released policy (`fmoe/fastermoe/shadow_policy.py`), a different walk
                (`moe/balancers/fastermoe.fastmoe_release_shadow`): experts by total rows,
                shadowing the first i leaves the (i+1)-th largest expert count as B_max, the token
                term is kept, and each shadow costs one parameter send (r Q / W_net, not 2 r Q)

With `printed` the first shadow's decision Lat_shadow(1, B') < Lat_imbl(B) is, rearranged (one
W_net for both),
    Eq. 9:  B_max > r Q / (2 H)      (the paper's B_max > r alpha H: moving the inputs costs more
                                     than moving the models), or
    Eq. 10: 3 (B_max - B'_max) F / (2 r Q - 4 H B_max) > P / W_net   (the compute saved outweighs
                                     the extra transfer; with F = 4 alpha H^2, Q = 2 alpha H^2 the
                                     paper's 3 (B_max - B'_max) alpha H / (r alpha H - B_max) > P / W_net).
`shadow_is_faster` evaluates the inequality itself (the profile's token and parameter bandwidths
may differ).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_moe.perf.hardware import BALANCER_OPS, HardwareProfile


EQ8 = ("printed", "token_term", "fastmoe")


@dataclass(frozen=True)
class ShadowCostModel:
    flops_per_row: float  # F: one row through one expert shard, forward
    params_per_expert: float  # Q: elements of one expert shard's parameters
    hidden: int  # H: elements of a token row
    seconds_per_flop: float  # 1 / P
    seconds_per_token_element: float  # 1 / W_net for token rows (p2p)
    seconds_per_param_element: float  # 1 / W_net for shadowed parameters (broadcast)
    eq8: str = "printed"  # printed | token_term | fastmoe (module docstring)

    @classmethod
    def from_profile(cls, profile: HardwareProfile, flops_per_row: float, params_per_expert: float,
                     hidden: int, eq8: str = "printed") -> "ShadowCostModel":
        profile.require(BALANCER_OPS, "moe.balancer=fastermoe")
        return cls(flops_per_row, params_per_expert, hidden, profile.expert_compute.beta, profile.p2p.beta,
                   profile.broadcast.beta, eq8)

    def lat_imbl(self, max_rows: float) -> float:
        """Eq. 7 at B_max (both terms grow with B_w, so the max is the busiest rank's)."""
        return self._compute(max_rows) + self._tokens(max_rows)

    def lat_shadow(self, shadowed: int, max_rows: float) -> float:
        """Eq. 8: r = `shadowed` experts broadcast (forward) and reduced (backward), B'_max rows
        (`fastmoe`: one send per shadow, the token term kept)."""
        sends = shadowed if self.eq8 == "fastmoe" else 2 * shadowed
        return self._compute(max_rows) + (self._tokens(max_rows) if self.eq8 != "printed" else 0.0) + \
            sends * self.params_per_expert * self.seconds_per_param_element

    def _compute(self, rows: float) -> float:
        return 3 * self.flops_per_row * rows * self.seconds_per_flop

    def _tokens(self, rows: float) -> float:
        return 4 * rows * self.hidden * self.seconds_per_token_element

    def shadow_is_faster(self, shadowed: int, max_rows: float, max_rows_shadowed: float) -> bool:
        """Eq. 9 or Eq. 10 for r experts: Lat_shadow(r, B') < Lat_imbl(B)."""
        return self.lat_shadow(shadowed, max_rows_shadowed) < self.lat_imbl(max_rows)

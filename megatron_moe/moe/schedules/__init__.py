"""Schedules: how tokens travel between ranks in an MoE layer (registry keyed by `moe.schedule`)."""
from megatron_moe.registry import Registry

SCHEDULES = Registry("moe.schedule")
# byte-counter kinds of the token all-to-alls (plain, SAA's phased point to point, the smart schedule's
# pairwise steps): metrics.jsonl's a2a_exposed_ms / a2a_total_ms, forward and backward
A2A_KINDS = ("all_to_all", "all_to_all_p2p", "smart_p2p")

from megatron_moe.moe.schedules import baseline  # noqa: E402,F401  (registers "baseline")
from megatron_moe.techniques.parm import parm  # noqa: E402,F401  (registers "s1", "s2", "auto")

"""Schedules: how tokens travel between ranks in an MoE layer (registry keyed by `moe.schedule`)."""
from megatron_moe.config.validate import section_check
from megatron_moe.config.registry import Registry

SCHEDULES = Registry("moe.schedule")  # entries: schedules/baseline.py, techniques/parm/parm.py
# byte-counter kinds of the token all-to-alls (plain, SAA's phased point to point, the smart schedule's
# pairwise steps): metrics.jsonl's a2a_exposed_ms / a2a_total_ms, forward and backward
A2A_KINDS = ("all_to_all", "all_to_all_p2p", "smart_p2p")


@section_check("moe.schedule")
def _check_schedule(cfg, world_size: int) -> None:
    SCHEDULES.get(cfg.moe.schedule)

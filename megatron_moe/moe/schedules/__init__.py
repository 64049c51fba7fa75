"""Schedules: how tokens travel between ranks in an MoE layer (registry keyed by `moe.schedule`)."""
from megatron_moe.registry import Registry

SCHEDULES = Registry("moe.schedule")

from megatron_moe.moe.schedules import baseline  # noqa: E402,F401  (registers "baseline")
from megatron_moe.moe.schedules import parm  # noqa: E402,F401  (registers "s1", "s2", "auto")

"""Balancers: policies that turn token counts into a Placement (registry keyed by `moe.balancer`)."""
from megatron_moe.config.validate import section_check
from megatron_moe.config.registry import Registry

BALANCERS = Registry("moe.balancer")  # entries: balancers/base.py ("none"), techniques/*/


@section_check("moe.balancer")
def _check_balancer(cfg, world_size: int) -> None:
    BALANCERS.get(cfg.moe.balancer)

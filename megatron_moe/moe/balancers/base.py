"""Placeholder; replaced by the balancer base and the owner-only ("none") policy."""
from megatron_moe.moe.balancers import BALANCERS


@BALANCERS.register("none")
class NoBalancer:
    pass

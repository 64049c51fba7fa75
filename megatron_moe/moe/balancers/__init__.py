"""Balancers: policies that turn token counts into a Placement (registry keyed by `moe.balancer`)."""
from megatron_moe.registry import Registry

BALANCERS = Registry("moe.balancer")

from megatron_moe.moe.balancers import base  # noqa: E402,F401  (registers "none")
from megatron_moe.techniques.fastermoe import fastermoe  # noqa: E402,F401  (registers "fastermoe")
from megatron_moe.techniques.proprophet import proprophet  # noqa: E402,F401  (registers "proprophet")
from megatron_moe.techniques.flexmoe import flexmoe  # noqa: E402,F401  (registers "flexmoe")
from megatron_moe.techniques.eplb import eplb  # noqa: E402,F401  (registers "eplb")

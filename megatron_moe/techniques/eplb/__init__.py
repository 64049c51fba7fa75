"""eplb (docs/design.md, the map)."""
import megatron_moe.moe.balancers  # noqa: F401  (the registry loads first, as when this lived under moe/)

"""parm (docs/design.md, the map)."""
import megatron_moe.moe.schedules  # noqa: F401  (the registry loads first, as when this lived under moe/)

"""One sub-package per technique: its runtime, planner and cost model (docs/design.md, the map)."""

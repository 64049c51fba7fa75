"""lancet (docs/design.md, the map)."""

"""node_dedup: see docs/design.md (the map) for its files, paper sections, config keys and tests."""
